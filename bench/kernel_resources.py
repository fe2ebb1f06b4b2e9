"""Registers, spills and shared memory of the decode step's Triton kernels, compiled for the H200 (sm_90) on any
machine, no GPU needed (`prism.testing.offline_compile`: Triton's compiler and the `ptxas` in its wheel).

    python bench/kernel_resources.py                        # the engine's knobs, 8B shapes, bf16, FP8 KV
    python bench/kernel_resources.py --set paged_attention._NUM_WARPS=8 --set paged_attention._BLOCK_N=64

Each row is one kernel as the engine launches it at W3's shapes: registers per thread, the stack frame, and the bytes
per thread ptxas spills to local memory (stores / loads). Integer arguments that are multiples of 16 at W3 are marked
as the JIT marks them: without that the compile is another kernel (session 18 read 3.6 KB of spills per thread in
the decode kernel that way; compiled as launched it has none). `--set` changes a module's launch knob before the rows are
built (`prism.ops.<module>.<NAME>=<int or name>`), as `config_ab.py --variants` does in the engine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from prism.ops import cascade_attention, fused_norms, gemv, paged_attention, qk_norm_rope_kv, skinny_gemm  # noqa: E402
from prism.testing.offline_compile import compile_for_hopper, ptxas_resources  # noqa: E402

# Qwen3-VL-8B's text decoder
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 12288
GROUP = HEADS // KV_HEADS
PDL = 2  # the engine's default (`pdl.TRIGGER_FIRST`)

GEMV_ARGS = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32", "stride_w": "i32",
             "sumsq_in_ptr": "*fp32", "P_IN": "i32", "norm_w_ptr": "*bf16", "eps": "fp32", "res_ptr": "*bf16",
             "sumsq_out_ptr": "*fp32"}
SILU_ARGS = {**{k: v for k, v in GEMV_ARGS.items() if k not in ("N", "res_ptr", "sumsq_out_ptr")}, "INTER": "i32"}
SKINNY_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32",
               "K": "i32", "K_PER_SPLIT": "i32", "stride_xm": "i32", "stride_w": "i32", "stride_ym": "i32",
               "INTER": "i32"}
POOL_ARGS = {"pay_ptr": "*u8", "sc_ptr": "*fp32", "row_k": "i32", "row_v": "i32", "stride_row": "i64",
             "stride_slot": "i32", "sc_stride_row": "i64"}
DECODE_ARGS = {"q_ptr": "*bf16", "out_ptr": "*bf16", "bt_ptr": "*i64", "ctx_ptr": "*i64", "prefix_ptr": "*i64",
               "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32",
               "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "page_size": "i32", "qk_scale": "fp32",
               "H": "i32", "HQ": "i32", "GROUP": "i32", "HEAD_DIM": "i32", **POOL_ARGS}
SHARED_ARGS = {"q_ptr": "*bf16", "bt_ptr": "*i64", "prefix_ptr": "*i64", "leader_ptr": "*i64",
               "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32",
               "stride_bt": "i32", "page_size": "i32", "qk_scale": "fp32", "B": "i32", "H": "i32", "HQ": "i32",
               "GROUP": "i32", "HEAD_DIM": "i32", **POOL_ARGS}
REDUCE_ARGS = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "stride_ot": "i32",
               "stride_oh": "i32", "HQ": "i32", "HEAD_DIM": "i32"}
QK_ARGS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
           "cos_ptr": "*bf16", "sin_ptr": "*bf16", "qo_ptr": "*bf16", "slots_ptr": "*i64", "stride_qt": "i32",
           "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32",
           "stride_cs": "i32", "HQ": "i32", "HKV": "i32", "eps": "fp32", "num_slots": "i32", **POOL_ARGS}
NORM_ARGS = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
             "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_s": "i32", "D": "i32", "eps": "fp32"}


# Integer arguments whose values at W3 are multiples of 16 (the launch specializes on it, as on aligned pointers;
# `M` is the few-rows GEMM's rows: its rows are named for 16)
MULTIPLES_OF_16 = ("N", "INTER", "P_IN", "M", "HQ", "HEAD_DIM", "page_size", "num_slots", "D")


def attention_constexprs() -> dict:
    """The launch constants both attention kernels share (`paged_decode_attention`'s `common`), FP8 KV, bf16 q."""
    return dict(KIND=0, BLOCK_D=HEAD_DIM, DOT_DTYPE=tl.float16, PRECISION="tf32", OFFSET_DTYPE=tl.int64,
                NATIVE_FP8=True)


def rows() -> dict[str, tuple]:
    """name -> (kernel, signature, constexprs, num_warps), with the modules' knobs as they are now."""
    # the folded norm's input: the partial sums of squares of O's / down's programs
    block_p = triton.next_power_of_2(triton.cdiv(HIDDEN, gemv.BLOCK_N))
    gemv_knobs = dict(BLOCK_N=gemv.BLOCK_N, BLOCK_K=gemv.BLOCK_K, NUM_STAGES=gemv.NUM_STAGES, PDL=PDL)
    silu_knobs = dict(BLOCK_N=gemv.SILU_BLOCK_N, BLOCK_K=gemv.SILU_BLOCK_K, NUM_STAGES=gemv.NUM_STAGES, PDL=PDL)
    skinny = dict(PRECISION="tf32", PDL=PDL, SPLIT_K=skinny_gemm.SPLIT_K)
    skinny_tiles = {silu: dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_STAGES"), skinny_gemm.tiles(16, silu, 2),
                                   strict=True)) for silu in (False, True)}
    decode = dict(BLOCK_G=16, BLOCK_N=paged_attention._BLOCK_N, NUM_STAGES=paged_attention._NUM_STAGES,
                  V_WITH_K=paged_attention._V_WITH_K, PDL=PDL, **attention_constexprs())
    splits_b1 = paged_attention.decode_num_splits(1, KV_HEADS, 2500)  # W3: ~2,500 tokens of context
    shared_splits = cascade_attention.SPLITS
    return {
        "GEMV, QKV (norm folded in)": (gemv._gemv_kernel, GEMV_ARGS,
                                       {**gemv_knobs, "NORM_IN": True, "BLOCK_P": block_p, "ADD_RESIDUAL": False},
                                       gemv.NUM_WARPS),
        "GEMV, O / down (residual out)": (gemv._gemv_kernel, GEMV_ARGS,
                                          {**gemv_knobs, "NORM_IN": False, "BLOCK_P": 1, "ADD_RESIDUAL": True},
                                          gemv.NUM_WARPS),
        "GEMV, gate/up + activation": (gemv._gemv_silu_and_mul_kernel, SILU_ARGS,
                                       {**silu_knobs, "NORM_IN": True, "BLOCK_P": block_p}, gemv.NUM_WARPS),
        "few-rows GEMM, 16 rows": (skinny_gemm._skinny_gemm_kernel, SKINNY_ARGS,
                                   {**skinny, **skinny_tiles[False], "SILU": False}, skinny_gemm.NUM_WARPS),
        "few-rows GEMM, 16 rows, gate/up": (skinny_gemm._skinny_gemm_kernel, SKINNY_ARGS,
                                            {**skinny, **skinny_tiles[True], "SILU": True}, skinny_gemm.NUM_WARPS),
        **({f"few-rows GEMM, its split sums ({skinny_gemm.SPLIT_K} splits)": (
            skinny_gemm._split_sums_kernel, {"part_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                                             "stride_ym": "i32"},
            dict(SPLIT_K=skinny_gemm.SPLIT_K, SILU=False, BLOCK=1024, PDL=PDL), 4)} if skinny_gemm.SPLIT_K > 1 else {}),
        "Q/K norm + rope + KV write": (qk_norm_rope_kv._qk_norm_rope_write_kv_kernel, QK_ARGS,
                                       dict(HALF=HEAD_DIM // 2, BLOCK_HQ=HEADS, BLOCK_HKV=KV_HEADS, DTYPE=tl.bfloat16,
                                            KIND=0, OFFSET_DTYPE=tl.int64, PDL=PDL), 4),
        f"decode attention, batch 1 ({splits_b1} splits)": (
            paged_attention._decode_kernel, DECODE_ARGS,
            {**decode, "NUM_SPLITS": splits_b1, "SPLIT_SLOTS": splits_b1, "SKIP_PREFIX": False},
            paged_attention._NUM_WARPS),
        "decode attention, cascade own tails (1 split)": (
            paged_attention._decode_kernel, DECODE_ARGS,
            {**decode, "NUM_SPLITS": 1, "SPLIT_SLOTS": 1 + shared_splits, "SKIP_PREFIX": True},
            paged_attention._NUM_WARPS),
        f"cascade shared pass ({shared_splits} splits)": (
            cascade_attention._shared_prefix_kernel, SHARED_ARGS,
            dict(SPLITS=shared_splits, FIRST_SLOT=1, SPLIT_SLOTS=1 + shared_splits, BLOCK_M=cascade_attention.BLOCK_M,
                 BLOCK_N=cascade_attention.BLOCK_N, NUM_STAGES=cascade_attention.NUM_STAGES,
                 V_WITH_K=cascade_attention.V_WITH_K, **attention_constexprs()),
            cascade_attention.NUM_WARPS),
        f"decode split reduce ({1 + shared_splits} slots)": (
            paged_attention._decode_reduce_kernel, REDUCE_ARGS,
            dict(NUM_SPLITS=1 + shared_splits, BLOCK_S=triton.next_power_of_2(1 + shared_splits), BLOCK_D=HEAD_DIM,
                 PDL=PDL), 4),
        "residual add + RMSNorm": (fused_norms._add_rms_norm_kernel, NORM_ARGS,
                                   dict(DTYPE=tl.bfloat16, BLOCK=HIDDEN, PDL=PDL), 4),
    }


def set_knob(assignment: str) -> None:
    name, _, value = assignment.partition("=")
    module_name, _, knob = name.rpartition(".")
    if not module_name or not value:
        raise SystemExit(f"--set: {assignment!r} is not module.NAME=VALUE")
    module = importlib.import_module(f"prism.ops.{module_name}")
    if not hasattr(module, knob):
        raise SystemExit(f"{module.__name__} has no knob {knob}")
    setattr(module, knob, int(value) if value.lstrip("-").isdigit() else
            {"true": True, "false": False}.get(value.lower(), value))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a launch knob of prism.ops.<module> (repeatable)")
    parser.add_argument("--only", default="", help="rows whose name contains this text")
    args = parser.parse_args()
    for assignment in args.set:
        set_knob(assignment)
    print(f"sm_90, 8B shapes, bf16 activations, FP8 KV{'; ' + ', '.join(args.set) if args.set else ''}")
    print("| kernel | warps | registers | stack B | spill stores B | spill loads B | shared KB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (kernel, signature, constexprs, warps) in rows().items():
        if args.only not in name:
            continue
        compiled = compile_for_hopper(kernel, signature, constexprs, num_warps=warps, multiples_of_16=MULTIPLES_OF_16)
        r = ptxas_resources(compiled.asm["ptx"])
        print(f"| {name} | {warps} | {r['registers']} | {r['stack_bytes']} | {r['spill_store_bytes']} | "
              f"{r['spill_load_bytes']} | {compiled.metadata.shared / 1024:.1f} |", flush=True)


if __name__ == "__main__":
    main()
