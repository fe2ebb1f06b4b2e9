"""Found by review (session 18): the few-rows GEMM split along K (`ops/skinny_gemm.py`, `_skinny_gemm_kernel` with
SPLIT_K > 1, and `_split_sums_kernel`) computed offsets as `M.to(tl.int64)`. A launch compiles an int argument
equal to 1 as a constant, which has no `.to`, so both kernels failed to compile for one row called directly (the
engine sends it 2 rows or more; `skinny_gemm` takes any). The CPU interpreter does not specialize: no test saw it.
Fixed when both compile for Hopper (sm_90, on this machine: no GPU is needed) with M specialized to 1."""

import os

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the interpreter compiles nothing

import _common  # noqa: E402

from prism.ops import skinny_gemm  # noqa: E402
from prism.testing import kernel_signatures as sig  # noqa: E402
from prism.testing.offline_compile import compile_error  # noqa: E402

gemm = compile_error(skinny_gemm._skinny_gemm_kernel, sig.without(sig.SKINNY_GEMM, "M"),
                     {"M": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "NUM_STAGES": 4, "SILU": True,
                      "SPLIT_K": 2, "PRECISION": "tf32", "PDL": True})
sums = compile_error(skinny_gemm._split_sums_kernel, sig.without(sig.SPLIT_SUMS, "M"),
                     {"M": 1, "SPLIT_K": 2, "SILU": True, "BLOCK": 1024, "PDL": True})
_common.verdict(gemm is None and sums is None,
                "the split-K few-rows GEMM and its sums compile for sm_90 with one row",
                f"compile failed: the GEMM: {gemm}; the sums: {sums}")
