"""The runtime arguments of the decode step's Triton kernels as Triton types, for compiling them without a launch
(`offline_compile.compile_for_hopper`): bf16 activations, a scaled-FP8 KV pool. Shared by the PTX checks of
`tests/test_pdl.py` and `bench/kernel_resources.py`, so that a kernel's signature is written down once (a kernel
whose arguments change fails both until this file follows). Constexpr arguments are the caller's: they are knobs.
"""

from __future__ import annotations

GEMV = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32", "stride_w": "i32",
        "sumsq_in_ptr": "*fp32", "P_IN": "i32", "norm_w_ptr": "*bf16", "eps": "fp32", "res_ptr": "*bf16",
        "sumsq_out_ptr": "*fp32"}
GEMV_SILU_AND_MUL = {**{k: v for k, v in GEMV.items() if k not in ("N", "res_ptr", "sumsq_out_ptr")},
                     "INTER": "i32"}
SKINNY_GEMM = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32",
               "K": "i32", "K_PER_SPLIT": "i32", "stride_xm": "i32", "stride_w": "i32", "stride_ym": "i32",
               "INTER": "i32"}
SPLIT_SUMS = {"part_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32", "stride_ym": "i32"}
ADD_RMS_NORM = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
                "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_s": "i32", "D": "i32", "eps": "fp32"}
_POOL = {"pay_ptr": "*u8", "sc_ptr": "*fp32", "row_k": "i32", "row_v": "i32", "stride_row": "i64",
         "stride_slot": "i32", "sc_stride_row": "i64"}
DECODE_ATTENTION = {"q_ptr": "*bf16", "out_ptr": "*bf16", "bt_ptr": "*i64", "ctx_ptr": "*i64", "prefix_ptr": "*i64",
                    "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32",
                    "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "page_size": "i32",
                    "qk_scale": "fp32", "H": "i32", "HQ": "i32", "GROUP": "i32", "HEAD_DIM": "i32", **_POOL}
SHARED_PREFIX = {"q_ptr": "*bf16", "bt_ptr": "*i64", "prefix_ptr": "*i64", "leader_ptr": "*i64",
                 "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32",
                 "stride_bt": "i32", "page_size": "i32", "qk_scale": "fp32", "B": "i32", "H": "i32", "HQ": "i32",
                 "GROUP": "i32", "HEAD_DIM": "i32", **_POOL}
DECODE_REDUCE = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "stride_ot": "i32",
                 "stride_oh": "i32", "HQ": "i32", "HEAD_DIM": "i32"}
QK_NORM_ROPE_WRITE_KV = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
                         "cos_ptr": "*bf16", "sin_ptr": "*bf16", "qo_ptr": "*bf16", "slots_ptr": "*i64",
                         "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32",
                         "stride_vt": "i32", "stride_vh": "i32", "stride_cs": "i32", "HQ": "i32", "HKV": "i32",
                         "eps": "fp32", "num_slots": "i32", **_POOL}


def without(signature: dict, *names: str) -> dict:
    """`signature` less `names`: arguments a launch compiles as constants (an int equal to 1), passed as constexprs."""
    return {k: v for k, v in signature.items() if k not in names}
