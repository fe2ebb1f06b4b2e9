"""The request head's deadline (`serving/header_deadline.py`) on the server as `prism serve` runs it (uvicorn in a
thread with the deadline's protocol, the tiny checkpoint), with raw sockets: a partial request line or partial headers
are a 408 and a closed connection at the deadline, a connection that sends nothing is closed, a kept-alive connection
gets a new deadline per request; a head in time is served, and neither a withheld body (the body's own deadline) nor a
response longer than the deadline is cut by it. Its setting, and a uvicorn it does not fit refused at start."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from prism.serving import header_deadline
from prism.serving.settings import ServerSettings
from prism.testing.serving import read_response, serve_in_thread

HEAD_S = 0.5
BODY_S = 1.5
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def live():
    server = serve_in_thread(ServerSettings(header_read_timeout_s=HEAD_S, body_read_timeout_s=BODY_S))
    yield server
    server.stop()


def _connect(live, timeout_s: float = 5) -> socket.socket:
    host, port = live.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(timeout_s)
    return sock


def _until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """(what the server sent until it closed the connection, the seconds that took)."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _connections_left(live, seconds: float = 2) -> int:
    state, deadline = live.server.server_state, time.time() + seconds
    while state.connections and time.time() < deadline:
        time.sleep(0.02)
    return len(state.connections)


@pytest.mark.parametrize("partial", [b"GET /hea", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAcc"])
def test_a_partial_head_is_a_408_that_closes_its_connection_at_the_deadline(live, partial):
    sock = _connect(live)
    sock.sendall(partial)
    data, took = _until_closed(sock)
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout") and b"connection: close" in head, data
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and f"within {HEAD_S:g} s" in error["message"], error
    assert HEAD_S - 0.05 <= took <= HEAD_S + 1, f"closed after {took:.2f} s"
    assert _connections_left(live) == 0


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(live):
    sock = _connect(live)
    data, took = _until_closed(sock)
    sock.close()
    assert data == b"" and HEAD_S - 0.05 <= took <= HEAD_S + 1, (data, took)


def test_a_kept_alive_connection_gets_a_deadline_per_request(live):
    """Two requests in time on one connection, then a partial third: 408 at the deadline counted from the second
    response (uvicorn's keep-alive timer stops at the first byte of the next request)."""
    sock = _connect(live)
    for _ in range(2):
        sock.sendall(HEALTH)
        status, _, body, closed = read_response(sock, closed_within_s=0.01)
        assert (status, body, closed) == (200, b"ok", False)
        sock.settimeout(5)
    time.sleep(HEAD_S * 0.7)
    sock.sendall(b"GET /he")
    data, took = _until_closed(sock)
    sock.close()
    assert data.startswith(b"HTTP/1.1 408"), data
    assert took <= HEAD_S * 0.3 + 0.2, f"closed {took:.2f} s after the partial head: its deadline moved"


def test_a_head_trickled_within_the_deadline_is_served(live):
    sock = _connect(live)
    for i in range(0, len(HEALTH), 8):
        sock.sendall(HEALTH[i:i + 8])
        time.sleep(HEAD_S * 0.6 / (len(HEALTH) / 8))
    status, _, body, closed = read_response(sock, closed_within_s=0.01)
    sock.close()
    assert (status, body, closed) == (200, b"ok", False)


def test_a_withheld_body_meets_the_bodys_deadline_not_the_heads(live):
    """Once the head is in, the request is the app's: its body has `body_read_timeout_s`."""
    sock = _connect(live)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n")
    start = time.monotonic()
    status, _, body, closed = read_response(sock)
    took = time.monotonic() - start
    sock.close()
    assert status == 408 and "request body" in json.loads(body)["error"]["message"], body
    assert BODY_S - 0.05 <= took <= BODY_S + 1, f"answered after {took:.2f} s, not at the body's deadline"



def test_a_body_nobody_reads_after_its_answer_is_cut_at_the_deadline(live):
    """The review of session 30: a body whose answer did not wait for it (a 404 here) is read by nobody, so the body's
    deadline never runs; a byte now and then held the connection for as long as the client kept sending."""
    sock = _connect(live, timeout_s=10)
    sock.sendall(b"POST /no-such-path HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
    start, received, closed = time.monotonic(), b"", False
    for _ in range(40):  # 4 s of a byte every 0.1 s, far past the 0.5 s deadline
        try:
            sock.sendall(b" ")
        except OSError:  # the server has closed the connection
            closed = True
        time.sleep(0.1)
        while not closed and _readable(sock):
            chunk = sock.recv(65536)
            closed = not chunk
            received += chunk
        if closed:
            break
    took = time.monotonic() - start
    sock.close()
    assert received.startswith(b"HTTP/1.1 404"), received
    assert closed and took < HEAD_S + 1.0, f"the connection stayed open {took:.2f} s while the unread body trickled"
    assert _connections_left(live) == 0


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])

def test_a_response_longer_than_the_deadline_is_not_cut(live, monkeypatch):
    engine = live.engine
    step = engine.step

    def slow_step(*args, **kwargs):
        time.sleep(0.05)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", slow_step)
    start = time.monotonic()
    with httpx.stream("POST", live.url + "/v1/completions", timeout=30, json={
            "model": "prism-tiny", "prompt": "Hello", "max_tokens": 24, "stream": True, "ignore_eos": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    took = time.monotonic() - start
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    assert took > HEAD_S * 1.5, f"the response took {took:.2f} s: too short to show anything"


@pytest.mark.parametrize("raw", ["0", "-1", "inf", "nan", "soon"])
def test_the_setting_is_checked_naming_its_variable(raw):
    with pytest.raises(ValueError, match="PRISM_HEADER_READ_TIMEOUT_S"):
        ServerSettings.from_env({"PRISM_HEADER_READ_TIMEOUT_S": raw})
    assert ServerSettings.from_env({"PRISM_HEADER_READ_TIMEOUT_S": "2.5"}).header_read_timeout_s == 2.5
    assert ServerSettings().header_read_timeout_s == 10.0


def test_a_uvicorn_without_the_hooks_is_refused_at_start(monkeypatch):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    monkeypatch.delattr(H11Protocol, "on_response_complete")
    with pytest.raises(RuntimeError, match=r"does not fit uvicorn [\d.]+: its H11Protocol has no on_response_complete"):
        header_deadline.header_deadline_protocol(1.0)


def test_a_uvicorn_keeping_its_h11_state_elsewhere_is_refused_at_start(monkeypatch):
    from uvicorn.protocols.http.h11_impl import H11Protocol

    init = H11Protocol.__init__

    def elsewhere(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.h11_connection = self.__dict__.pop("conn")

    monkeypatch.setattr(H11Protocol, "__init__", elsewhere)
    with pytest.raises(RuntimeError, match="keeps no h11.Connection in .conn"):
        header_deadline.header_deadline_protocol(1.0)


def test_the_uvicorn_command_takes_the_deadline_as_its_http_protocol(monkeypatch):
    """`uvicorn --http prism.serving.header_deadline:H11Protocol src.prism.server:app`: uvicorn imports the protocol,
    made with PRISM_HEADER_READ_TIMEOUT_S."""
    import uvicorn

    async def app(scope, receive, send) -> None:
        raise AssertionError("not called")

    monkeypatch.setenv("PRISM_HEADER_READ_TIMEOUT_S", "4")
    config = uvicorn.Config(app, http="prism.serving.header_deadline:H11Protocol", log_config=None)
    config.load()
    assert config.http_protocol_class.header_read_timeout_s == 4.0
    monkeypatch.setenv("PRISM_HEADER_READ_TIMEOUT_S", "never")
    with pytest.raises(ValueError, match="PRISM_HEADER_READ_TIMEOUT_S"):
        header_deadline.H11Protocol  # noqa: B018 - what uvicorn's import does
