"""Found by review (session 16): the MLP's fused gate/up GEMV (`ops/gemv.py` `_gemv_silu_and_mul_kernel`) computed
its up rows' offset as `INTER.to(tl.int64)`. Triton compiles an int argument equal to 1 as a constant, which has no
`.to`, so a weight of one gate row and one up row failed to compile on a GPU; the interpreter the CPU tests use does
not specialize, so no test saw it. Fixed when the kernel compiles for Hopper (sm_90, PDL on, on this machine: no GPU
is needed) with INTER specialized to 1, and with a general INTER."""

import os

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the interpreter compiles nothing

import _common  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from prism.ops import gemv  # noqa: E402


def compile_error(signature: dict, constexprs: dict) -> str | None:
    constexprs = {"BLOCK_N": 8, "BLOCK_K": 512, "NUM_STAGES": 3, "PDL": True, "NORM_IN": False, "BLOCK_P": 1,
                  **constexprs}
    norm_in = {"sumsq_in_ptr": "*fp32", "P_IN": "i32", "norm_w_ptr": "*bf16", "eps": "fp32"}
    full = {"w_ptr": "*bf16", "x_ptr": "*bf16", "y_ptr": "*bf16", **signature, **norm_in,
            **dict.fromkeys(constexprs, "constexpr")}
    try:
        triton.compile(ASTSource(fn=gemv._gemv_silu_and_mul_kernel, signature=full, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
    except Exception as error:  # the compiler's own error, whatever its type
        return f"{type(error).__name__}: {str(error)[-300:]}"
    return None


one_row = compile_error({"K": "i32", "stride_w": "i32"}, {"INTER": 1})
general = compile_error({"INTER": "i32", "K": "i32", "stride_w": "i32"}, {})
_common.verdict(one_row is None and general is None,
                "the fused gate/up GEMV compiles for sm_90 with a one-row intermediate and a general one",
                f"compile failed: one row: {one_row}; general: {general}")
