"""Found in session 14: when the vision encoder failed on a waiting request's media while encoding them ahead (in a
step that only decodes others), the whole step failed, and every request decoding in it ended with that error.
The media belong to the waiting request alone: it fails, the decodes go on. Runs the test's scenario on the tiny
checkpoint (CPU) with a planted encoder failure."""

import _common  # noqa: F401
import pytest

sys_path_tests = str(_common.ROOT / "tests")
import sys  # noqa: E402

sys.path.insert(0, sys_path_tests)
from test_encode_ahead import decodes_beside_a_failing_encoding  # noqa: E402

with pytest.MonkeyPatch.context() as monkeypatch:
    try:
        got, want, cold = decodes_beside_a_failing_encoding(monkeypatch)
        ok = got == want and cold.finish_reason.value == "error"
        detail = f"decoders' tokens {got} vs without the cold request {want}; cold: {cold.finish_reason}"
    except AssertionError as error:
        ok, detail = False, str(error)
_common.verdict(ok, "a failed encoding ahead fails its own request; the decodes finish unchanged", detail)
