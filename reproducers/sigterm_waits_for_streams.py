"""Found by an operator's review (session 28): SIGTERM to `uvicorn src.prism.server:app` with streams in flight did
not stop the server: uvicorn's graceful shutdown waits for open responses, and a stream may run for the whole
context (four streams were still generating 295 s after the signal); the clients got cut-off bodies. Now the app
aborts every request on SIGINT / SIGTERM first: each stream ends with an error event and [DONE], and the server
exits. Here: three long streams, SIGTERM, and the process must exit within 30 s with every stream ended so, its error
a 503 saying the server is shutting down (session 29: for a while it was the internal error of a failed server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import _common
import httpx

PORT = 18093
URL = f"http://127.0.0.1:{PORT}"
env = dict(os.environ, PYTHONPATH=str(_common.ROOT / "src"))
server = subprocess.Popen([sys.executable, "-m", "uvicorn", "src.prism.server:app", "--port", str(PORT)],
                          cwd=_common.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(600):
        try:
            if httpx.get(URL + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    endings: list[list[str]] = []

    def stream() -> None:
        body = {"model": "prism-tiny", "messages": [{"role": "user", "content": "Talk."}], "max_tokens": 30000,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", URL + "/v1/chat/completions", json=body, timeout=60) as response:
                endings.append([line for line in response.iter_lines() if line][-2:])
        except httpx.HTTPError as error:
            endings.append([f"{type(error).__name__}"])

    clients = [threading.Thread(target=stream) for _ in range(3)]
    for client in clients:
        client.start()
    time.sleep(3)
    start = time.time()
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
        took = time.time() - start
    except subprocess.TimeoutExpired:
        took = None
    for client in clients:
        client.join(10)
finally:
    if server.poll() is None:
        server.kill()
ended = [e for e in endings if len(e) == 2 and e[1] == "data: [DONE]" and '"error"' in e[0] and "shutting down" in e[0]]
exit_text = "no exit within 30 s" if took is None else f"an exit in {took:.1f} s"
_common.verdict(took is not None and len(ended) == 3,
                f"SIGTERM: {exit_text}, each of 3 streams ended with a 'shutting down' error event and [DONE]",
                f"SIGTERM with 3 streams in flight: {exit_text}, stream endings {endings}")
