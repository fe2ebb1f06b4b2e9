"""Found by review (session 22): /v1/decide parsed its body with `json.loads`, which raises RecursionError (not a
JSONDecodeError) on deeply nested arrays: a 500 where the chat endpoint answers 400. Fixed when the decide body is
parsed and validated in one pass by pydantic, as the chat body is."""

import _common  # noqa: F401

from prism.serving.decide_protocol import parse_decide_request  # noqa: E402
from prism.serving.protocol import ProtocolError  # noqa: E402

try:
    parse_decide_request(b"[" * 5000 + b"]" * 5000)
    ok, detail = False, "accepted"
except ProtocolError as error:
    ok, detail = True, f"ProtocolError (400): {error}"
except RecursionError as error:
    ok, detail = False, f"RecursionError (a 500): {error}"
_common.verdict(ok, detail, detail)
