"""A legacy completion's `text_offset` counted the U+FFFD of a character cut short only after the token that cut it:
the answer "\\xe4" + "a" (a lead byte, then a byte that cannot continue it) reads "\\ufffda", but its offsets were
[0, 0], so "a" did not start at its offset (the OpenAI layout: `text[text_offset[i]:]` starts with token i's text
when that text is whole characters). Fixed when a character ends in the token holding its last byte, so that the byte
cutting it comes after it (`LegacyLogprobs._cut_before`)."""

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.scripted_tokens import scripted_tokens  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
tok = served.engine.inputs.tokenizer
body = [tok.token_to_id("ä"), tok.token_to_id("a")]  # the bytes 0xe4 (a lead byte) and "a"
assert tok.decode(body) == "\ufffda", "premise: a lead byte cut by an ASCII byte"
ask = {"model": served.app.state.prism.settings.served_model_name, "prompt": "Hi", "max_tokens": len(body),
       "temperature": 0, "logprobs": 0, "ignore_eos": True}
try:
    with scripted_tokens(served.engine, lambda request_id: body):
        choice = httpx.post(served.url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]
finally:
    served.server.should_exit = True
offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
_common.verdict(choice["text"] == "\ufffda" and offsets == [0, 1],
                f"the text {choice['text']!r} has its tokens {tokens} at their offsets {offsets}",
                f"the text {choice['text']!r} has the tokens {tokens} at the offsets {offsets}, want [0, 1]: "
                f"\"a\" is at 1")
