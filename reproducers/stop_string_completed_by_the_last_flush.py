"""A stop string that only the stream's last flush completes: the token budget ends the answer one byte short of
"쀍", so the stream holds "ok " + two bytes back and its flush gives "ok \ufffd", which holds the stop string
"k \ufffd". The answer was cut before it ("o") but ended with finish reason "length", offline and on the server,
streamed or not; a stop string completed mid-stream ends with "stop". Fixed when the engine takes the stop its
stream's flush found as the reason (`Engine._last_text`)."""

import json

import _common
import httpx  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.scripted_tokens import scripted_tokens  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

STOP = "k \ufffd"

llm = LLM(ensure_tiny_checkpoint(), num_gpu_pages=64)
body = llm.engine.inputs.tokenizer.encode("ok 쀍").ids[:-1]
params = SamplingParams(max_tokens=len(body), temperature=0.0, ignore_eos=True, stop=(STOP,))
with scripted_tokens(llm.engine, lambda request_id: body):
    (whole,) = llm.generate(["Hi"], params)
    events = list(llm.stream("Hi", params))
got = {"offline generate": (whole.text, whole.finish_reason.value),
       "offline stream": ("".join(e.new_text for e in events), events[-1].finish_reason.value)}

served = serve_in_thread(ServerSettings())  # the embedded tiny checkpoint
ask = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Hi"}],
       "max_tokens": len(body), "stop": [STOP], "ignore_eos": True}
try:
    with scripted_tokens(served.engine, lambda request_id: body):
        choice = httpx.post(served.url + "/v1/chat/completions", json=ask, timeout=60).json()["choices"][0]
        got["server"] = (choice["message"]["content"], choice["finish_reason"])
        with httpx.stream("POST", served.url + "/v1/chat/completions", json={**ask, "stream": True}, timeout=60) as r:
            chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
finally:
    served.server.should_exit = True
deltas = [choice for chunk in map(json.loads, chunks) for choice in chunk["choices"]]
got["server stream"] = ("".join(d["delta"].get("content") or "" for d in deltas), deltas[-1]["finish_reason"])
wrong = {where: answer for where, answer in got.items() if answer != ("o", "stop")}
_common.verdict(not wrong, f"each of {list(got)} answers 'o', cut before {STOP!r}, with finish reason 'stop'",
                f"want ('o', 'stop') cut before {STOP!r}, got {wrong}")
