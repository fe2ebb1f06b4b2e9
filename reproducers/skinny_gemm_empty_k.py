"""Found by review (session 18): `skinny_gemm` with an inner dimension of 0 divided by zero when it sized its K
splits (`k_per_split` came out 0), where `F.linear` returns zeros. Fixed when both products of an empty K are zeros
of the right shape, as `F.linear` (and silu(0) * 0) give them. Runs the Triton interpreter on the CPU."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # the kernel on the CPU

import _common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from prism.ops import skinny_gemm  # noqa: E402

try:
    product = skinny_gemm.skinny_gemm(torch.zeros(3, 0), torch.zeros(5, 0))
    gated = skinny_gemm.skinny_gemm_silu_and_mul(torch.zeros(3, 0), torch.zeros(10, 0))
    ok = torch.equal(product, F.linear(torch.zeros(3, 0), torch.zeros(5, 0))) and torch.equal(gated, torch.zeros(3, 5))
    detail = f"got {tuple(product.shape)} and {tuple(gated.shape)}, not zeros of [3, 5]"
except Exception as error:  # the bug: ZeroDivisionError
    ok, detail = False, f"{type(error).__name__}: {error}"
_common.verdict(ok, "an empty inner dimension gives zeros, as F.linear does", detail)
