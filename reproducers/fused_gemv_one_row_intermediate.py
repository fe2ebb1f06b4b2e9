"""Found by review (session 16): the MLP's fused gate/up GEMV (`ops/gemv.py` `_gemv_silu_and_mul_kernel`) computed
its up rows' offset as `INTER.to(tl.int64)`. Triton compiles an int argument equal to 1 as a constant, which has no
`.to`, so a weight of one gate row and one up row failed to compile on a GPU; the interpreter the CPU tests use does
not specialize, so no test saw it. Fixed when the kernel compiles for Hopper (sm_90, PDL on, on this machine: no GPU
is needed) with INTER specialized to 1, and with a general INTER."""

import os

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the interpreter compiles nothing

import _common  # noqa: E402

from prism.ops import gemv  # noqa: E402
from prism.testing import kernel_signatures as sig  # noqa: E402
from prism.testing.offline_compile import compile_error  # noqa: E402

KNOBS = {"BLOCK_N": 8, "BLOCK_K": 512, "NUM_STAGES": 3, "PDL": True, "NORM_IN": False, "BLOCK_P": 1}
one_row = compile_error(gemv._gemv_silu_and_mul_kernel, sig.without(sig.GEMV_SILU_AND_MUL, "INTER"),
                        {**KNOBS, "INTER": 1})
general = compile_error(gemv._gemv_silu_and_mul_kernel, sig.GEMV_SILU_AND_MUL, KNOBS)
_common.verdict(one_row is None and general is None,
                "the fused gate/up GEMV compiles for sm_90 with a one-row intermediate and a general one",
                f"compile failed: one row: {one_row}; general: {general}")
