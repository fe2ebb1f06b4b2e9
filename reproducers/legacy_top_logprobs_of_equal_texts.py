"""A legacy completion's `top_logprobs` listed the chosen token with another token's logprob: tokens of equal text are
one entry, and the entry kept the last (least likely) one's. The byte tokens of a split character all read U+FFFD,
so the answer "쀍" (three byte tokens), each with a runner-up byte token, answered `token_logprobs[i]` -0.31 but
`top_logprobs[i]["\ufffd"]` -1.31 (the runner-up's). Fixed when each text is listed with its most likely token's
logprob and the chosen token's text with its own (`LegacyLogprobs._top`)."""

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.scripted_tokens import scripted_tokens  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
tok = served.engine.inputs.tokenizer
body = tok.encode("쀍").ids
runner_up = tok.token_to_id("¿")  # the byte 0xbf: a continuation byte, U+FFFD alone as each of the answer's bytes
assert all(tok.decode([t]) == "\ufffd" for t in body) and runner_up not in body, "premise: three byte tokens"
ask = {"model": served.app.state.prism.settings.served_model_name, "prompt": "Hi", "max_tokens": len(body),
       "temperature": 0, "logprobs": 2, "ignore_eos": True}
try:
    with scripted_tokens(served.engine, lambda request_id: body, lambda request_id: [{runner_up: -1.0}] * len(body)):
        logprobs = httpx.post(served.url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]["logprobs"]
finally:
    served.server.should_exit = True
listed = [top.get(token) for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)]
_common.verdict(listed == logprobs["token_logprobs"],
                f"each chosen token is listed in top_logprobs with its own logprob {logprobs['token_logprobs']}",
                f"top_logprobs list the chosen tokens with {listed}, their own logprobs are "
                f"{logprobs['token_logprobs']}: {logprobs['top_logprobs']}")
