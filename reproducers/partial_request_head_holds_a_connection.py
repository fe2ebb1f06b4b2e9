"""Found by a review of the server (slowloris, before the body): a client that opened a connection and sent part of
a request line ("GET /hea") held it for as long as it kept it open; uvicorn's h11 protocol starts no timer before a
request is complete, and the body's deadline only starts once the app has the request. Fixed when the server as
`prism serve` runs it closes a connection whose request head has not all arrived within `header_read_timeout_s`
(PRISM_HEADER_READ_TIMEOUT_S, 10 s by default) of its being ready for one, with a 408 (`serving/header_deadline.py`).
Checked here with a 1 s deadline: the connection closed within 5 s."""

import socket
import time

import _common

from prism.serving.settings import ServerSettings  # noqa: E402
from prism.testing.serving import serve_in_thread  # noqa: E402

served = serve_in_thread(ServerSettings.from_env({"PRISM_HEADER_READ_TIMEOUT_S": "1"}))
host, port = served.url.removeprefix("http://").rsplit(":", 1)
sock = socket.create_connection((host, int(port)))
sock.settimeout(5)
sock.sendall(b"GET /hea")
start = time.time()
answer, closed = b"", False
try:
    while chunk := sock.recv(65536):
        answer += chunk
    closed = True
except TimeoutError:
    pass
waited = time.time() - start
held = len(served.server.server_state.connections)
sock.close()
served.stop()
status_line = answer.split(b"\r\n", 1)[0]
_common.verdict(closed and answer.startswith(b"HTTP/1.1 408"),
                f"the partial request line was answered {status_line!r} and its connection closed "
                f"after {waited:.1f} s",
                f"a connection that sent 'GET /hea' was {'closed' if closed else 'still open'} after {waited:.1f} s "
                f"(answered {answer[:40]!r}; the server holds {held} connection(s))")
