"""Found by review (session 19): on a machine without Triton (an optional extra), `gemv.linear` of 17-32 rows raised
NameError. The few-rows GEMM's dispatch asked whether the launch was in its narrow band (a tile count through
`triton.cdiv`) before whether the kernel could run at all, so every model with `batch1_gemv` on (the engine's
default) failed on its first prefill or decode step of 17-32 rows. Fixed when such a step keeps `F.linear` there."""

import sys

sys.modules["triton"] = None  # this machine has no Triton: `import triton` raises ImportError

import _common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from prism.ops import gemv, kv_write  # noqa: E402

assert not kv_write.HAVE_TRITON, "the reproducer must run without Triton"
w = torch.randn(24, 40, dtype=torch.bfloat16)
xs = [torch.randn(rows, 40, dtype=torch.bfloat16) for rows in (2, 20, 32)]
try:
    ok = all(torch.equal(gemv.linear(x, w), F.linear(x, w)) for x in xs)
    detail = "a product differs from F.linear's"
except Exception as error:  # the bug: NameError: name 'triton' is not defined
    ok, detail = False, f"{type(error).__name__}: {error}"
_common.verdict(ok, "without Triton, 2-32 rows keep F.linear", detail)
