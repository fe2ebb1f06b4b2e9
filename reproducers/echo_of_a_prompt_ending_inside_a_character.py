"""A legacy completion echoing a prompt of token ids that ends inside a character: "Hi" and the first byte of "쀍",
the answer its two other bytes and " ok". The echo showed the cut character as U+FFFD and the answer, decoded on its
own, began with one U+FFFD per byte: "Hi\\ufffd\\ufffd\\ufffd ok", where the decode of prompt and answer together is
"Hi쀍 ok" (vLLM gives "Hi\\ufffd쀍 ok"). Fixed when a request's text continues its prompt's incomplete last
character (`engine.detokenize.incomplete_tail`) and the echo leaves that character to it (`app._prompt_ends`)."""

import json

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.scripted_tokens import scripted_tokens  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
tok = served.engine.inputs.tokenizer
cut = tok.encode("쀍").ids
assert len(cut) == 3, "premise: 쀍 is three byte tokens"
prompt, body = tok.encode("Hi").ids + cut[:1], cut[1:] + tok.encode(" ok").ids
want = tok.decode(prompt + body)
assert want == "Hi쀍 ok", "premise"
ask = {"model": served.app.state.prism.settings.served_model_name, "prompt": prompt, "echo": True,
       "max_tokens": len(body), "temperature": 0, "ignore_eos": True}
try:
    with scripted_tokens(served.engine, lambda request_id: body):
        whole = httpx.post(served.url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]["text"]
        streamed = httpx.post(served.url + "/v1/completions", json=ask | {"stream": True}, timeout=60).text
finally:
    served.server.should_exit = True
chunks = [line.removeprefix("data: ") for line in streamed.split("\n\n") if line.startswith("data: {")]
streamed_text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if json.loads(c)["choices"])
_common.verdict(whole == streamed_text == want,
                f"the echo and the answer read {want!r}, the decode of prompt and answer together",
                f"the echo and the answer read {whole!r} (streamed {streamed_text!r}), the decode of prompt and answer "
                f"together is {want!r}")
