"""The real server in a thread of the calling process, for tests, reproducers and the HTTP benchmark: the app from
`create_app`, under uvicorn on a free local port. Owns no invariant; it is how the others reach one over HTTP."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..serving.app import create_app
from ..serving.header_deadline import header_deadline_protocol
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
    has not within `start_timeout_s`), as `prism serve` serves it (the request head's deadline on uvicorn's h11
    protocol). `uvicorn_config`: more `uvicorn.Config` arguments (log level "warning" unless given)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    app = create_app(settings)
    protocol = header_deadline_protocol(settings.header_read_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           **{"log_level": "warning", "http": protocol, **uvicorn_config}))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError(f"the server did not start within {start_timeout_s} s")
        time.sleep(0.05)
    return ServedApp(app, server, thread, f"http://127.0.0.1:{port}")


def requests_left_after(engine, seconds: float) -> list[str]:
    """The engine's requests still there after waiting up to `seconds` for them to go, and for the events of those
    gone (an abort's) to be delivered: until then the engine thread calls `step` once more, which a failure planted
    next (`failing_at`) would take for its own call."""
    deadline = time.time() + seconds
    while (engine.requests or engine.has_unfinished_requests()) and time.time() < deadline:
        time.sleep(0.05)
    return list(engine.requests)


def open_request(url: str, path: str, content_length: int, timeout_s: float = 10.0) -> socket.socket:
    """A raw connection to the server at `url` that has sent a POST's headers (JSON, `content_length` declared) and
    none of its body: the caller sends that, or withholds it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(timeout_s)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {content_length}\r\n\r\n".encode())
    return sock


def read_response(sock: socket.socket, closed_within_s: float = 0.5) -> tuple[int, dict[str, str], bytes, bool] | None:
    """(status, headers in lower case, body, whether the server closed the connection within `closed_within_s` after
    it) of the response on `sock` (a Content-Length one), or None when none came within the socket's timeout."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(body) < int(headers.get("content-length", 0)):
            body += sock.recv(65536)
    except TimeoutError:
        return None
    sock.settimeout(closed_within_s)
    try:
        closed = sock.recv(1) == b""
    except TimeoutError:
        closed = False
    except ConnectionResetError:  # closed with some of what was sent unread
        closed = True
    return int(lines[0].split()[1]), headers, body, closed


def handlers_left_after(served: ServedApp, seconds: float) -> tuple[int, list[str]]:
    """(uvicorn's request tasks still running, the engine's requests still there) after waiting up to `seconds` for
    both to go."""
    state = served.server.server_state
    deadline = time.time() + seconds
    while (state.tasks or served.engine.requests) and time.time() < deadline:
        time.sleep(0.05)
    return len(state.tasks), list(served.engine.requests)


@contextmanager
def replaced(owner, name: str, value):
    """While the block runs, `owner.name` (a module's, a class's or an object's attribute) is `value`; after it,
    what it was (an object's own attribute restored, one it did not have removed)."""
    own, had_own = vars(owner).get(name, None), name in vars(owner)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)


@contextmanager
def failing_at(owner, name: str, error: BaseException, at_call: int = 1):
    """While the block runs, `owner.name` (a module's, a class's or an object's callable) raises `error` at its
    `at_call`-th call and is itself at the others: a failure planted in a served app."""
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == at_call:
            raise error
        return real(*args, **kwargs)

    with replaced(owner, name, failing):
        yield
