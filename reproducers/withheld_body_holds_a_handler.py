"""Found by an operator's review of the server (slowloris): a client that sent a POST's headers (Content-Length: 100)
and then nothing was never answered; its connection and its handler were held for as long as it kept the connection
open, and a graceful shutdown waited for that handler. Fixed when the body must arrive within
`body_read_timeout_s` (PRISM_BODY_READ_TIMEOUT_S, 30 s by default) of its first read, or the request is a 408 and its
connection is closed (`serving/body_deadline.py`). Checked here with a 1 s deadline: the answer within 5 s."""

import socket
import time

import _common

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings.from_env({"PRISM_BODY_READ_TIMEOUT_S": "1"}))
host, port = served.url.removeprefix("http://").rsplit(":", 1)
sock = socket.create_connection((host, int(port)))
sock.settimeout(5)
sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
             "Content-Length: 100\r\n\r\n".encode())
start = time.time()
try:
    answer = sock.recv(65536).split(b"\r\n", 1)[0].decode()
except TimeoutError:
    answer = None
waited = time.time() - start
held = len(served.server.server_state.tasks)
sock.close()
served.stop()  # the engine thread stopped before the process exits
_common.verdict(answer is not None and answer.startswith("HTTP/1.1 408"),
                f"the withheld body was answered {answer!r} after {waited:.1f} s",
                f"a POST whose body never came was answered {answer!r} after {waited:.1f} s; {held} handler(s) "
                "still waiting for it")
