"""The real server in a thread of the calling process, for tests, reproducers and the HTTP benchmark: the app from
`create_app`, under uvicorn on a free local port. Owns no invariant; it is how the others reach one over HTTP."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from ..serving.app import create_app
from ..serving.settings import ServerSettings


@dataclass
class ServedApp:
    app: object  # the FastAPI app (its state: `app.state.prism`)
    server: object  # the uvicorn.Server
    thread: threading.Thread
    url: str  # http://127.0.0.1:<port>

    @property
    def engine(self):
        return self.app.state.prism.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def serve_in_thread(settings: ServerSettings, *, start_timeout_s: float = 120, **uvicorn_config) -> ServedApp:
    """`create_app(settings)` served on 127.0.0.1 in a daemon thread, once uvicorn has started (RuntimeError if it
    has not within `start_timeout_s`). `uvicorn_config`: more `uvicorn.Config` arguments (log level "warning"
    unless given)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           **{"log_level": "warning", **uvicorn_config}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError(f"the server did not start within {start_timeout_s} s")
        time.sleep(0.05)
    return ServedApp(app, server, thread, f"http://127.0.0.1:{port}")


def requests_left_after(engine, seconds: float) -> list[str]:
    """The engine's requests still there after waiting up to `seconds` for them to go."""
    deadline = time.time() + seconds
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    return list(engine.requests)
