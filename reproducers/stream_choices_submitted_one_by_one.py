"""Found by review (session 22): the choices of a completion (n > 1) were submitted one at a time, each at the
previous one's first token, and the response began only when all had started. With more choices than the engine
has seats the stream sent no byte until earlier choices had finished (seconds to minutes), and a client leaving
in that window was never seen: its requests ran on. Fixed when every choice is submitted at once and the
response starts as soon as the engine accepted them (`AsyncEngine.start_generation`)."""

import json
import tempfile
import time
from pathlib import Path

import _common
import httpx  # noqa: E402

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import requests_left_after, serve_in_thread  # noqa: E402

config = Path(tempfile.mkdtemp()) / "two_seats.json"
config.write_text(json.dumps({"max_num_seqs": 2}))
served = serve_in_thread(ServerSettings(engine_config_path=config))  # tiny checkpoint, 2 seats
body = {"model": served.app.state.prism.settings.served_model_name, "messages": [{"role": "user", "content": "Talk."}],
        "max_tokens": 3000, "n": 6, "ignore_eos": True, "stream": True}
start = time.time()
try:
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=10) as response:
        next(response.iter_lines())
        waited, submitted = time.time() - start, len(served.engine.requests)
except httpx.TimeoutException:
    waited, submitted = time.time() - start, len(served.engine.requests)
left = requests_left_after(served.engine, 5)
served.server.should_exit = True
_common.verdict(waited < 5 and submitted == 6 and not left,
                f"six choices on two seats: first chunk after {waited:.1f} s, all submitted, all aborted when the "
                "client left",
                f"first chunk after {waited:.1f} s with {submitted} of 6 choices submitted; still running after the "
                f"client left: {left}")
