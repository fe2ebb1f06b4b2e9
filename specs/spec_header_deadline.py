"""Spec of the request head's deadline (`serving/header_deadline.py`), over real HTTP: the server as `prism serve` runs
it (uvicorn in a thread with the deadline's protocol, the tiny checkpoint), raw sockets; with its planted bugs.

Invariant: a request head (request line and headers) that arrives whole within `header_read_timeout_s` of its
connection being ready for one (opened, or its previous response complete), in however many pieces with whatever
pauses, is served; one that has not all arrived by then (part of it withheld, or trickled past the deadline) has its
connection closed at the deadline: with a 408 if part of a head came, without a word if nothing did. A request answered
before its body was read (a 404, a 413 from the declared Content-Length) has its connection closed at the same
deadline counted from that answer, without a word after it, however the rest of the body trickles. The server holds
no connection after. (The reviews: uvicorn starts no timer before a request is complete, so a client that sent part
of a request line held its connection for as long as it kept it open; and nobody reads a body after its early answer,
so the body's deadline never ran for it and a byte now and then held the connection.) Times are kept a margin away
from the deadline on either side.
"""

from __future__ import annotations

import asyncio
import functools
import json
import select
import socket
import time
from dataclasses import dataclass

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.serving.settings import ServerSettings
from prism.testing.serving import read_response, serve_in_thread
from specs.spec_body_deadline import TIMEOUT_S, deliveries

HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@functools.lru_cache(maxsize=1)
def served():
    return serve_in_thread(ServerSettings(header_read_timeout_s=TIMEOUT_S))  # a daemon thread: it ends with the process


# (pieces of the head, the pause before each, how it ends: "in time", "withheld" or "trickled"), and whether a
# request-response cycle comes first on the connection: paced as the body's spec paces a body.
DELIVERIES = st.tuples(deliveries(HEAD), st.booleans())

# The POSTs answered before their body is read, by status: (path, declared Content-Length). Both declare more than
# any trickle sends, so the body never completes.
EARLY_ANSWERS = {404: ("/no-such-path", 10**6), 413: ("/v1/chat/completions", 10**10)}


@dataclass(frozen=True)
class UnreadBody:
    """A POST answered before its body is read (`status`), `with_head` bytes of the body in the head's packet, then
    `piece` bytes every `period_s` seconds, on a fresh connection or `after_a_response`."""

    status: int
    with_head: int
    piece: int
    period_s: float
    after_a_response: bool


UNREAD_BODIES = st.builds(UnreadBody, st.sampled_from(sorted(EARLY_ANSWERS)), st.integers(0, 64), st.integers(1, 64),
                          st.floats(0.02, 0.25), st.booleans())


def _connect(after_a_response: bool) -> socket.socket:
    """A connection ready for a request head: just opened, or after one request-response cycle."""
    host, port = served().url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(TIMEOUT_S + 3)
    if after_a_response:
        sock.sendall(HEAD)
        response = read_response(sock, closed_within_s=0.01)
        assert response is not None and response[0] == 200, f"the first request was answered {response}"
        sock.settimeout(TIMEOUT_S + 3)
    return sock


def _deliver(sock: socket.socket, pieces: list[bytes], pauses: list[float], how: str) -> tuple[float, float | None]:
    """Send the pieces after their pauses, until the server answers or closes; (the seconds from the connection's
    being ready to that, or to giving up on it; the seconds to the first byte sent, None if none was)."""
    start, first_sent = time.monotonic(), None
    for i, (piece, pause) in enumerate(zip(pieces, pauses, strict=True)):
        if select.select([sock], [], [], pause)[0]:
            return time.monotonic() - start, first_sent  # answered (or closed) before the head was in
        if how == "withheld" and i == len(pieces) - 1:
            break
        if first_sent is None:
            first_sent = time.monotonic() - start
        sock.sendall(piece)
    select.select([sock], [], [], TIMEOUT_S + 2)
    return time.monotonic() - start, first_sent


def _until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (TimeoutError if it does not within a second)."""
    sock.settimeout(1)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # closed with some of what was sent unread
        pass
    return data


def _connections_left(seconds: float) -> int:
    state = served().server.server_state
    deadline = time.time() + seconds
    while state.connections and time.time() < deadline:
        time.sleep(0.02)
    return len(state.connections)


def _trickle_until_closed(sock: socket.socket, client: UnreadBody) -> tuple[float, bytes]:
    """Send the body's pieces every `period_s` until the server closes the connection, or for 2 s past the deadline;
    (the seconds from the early answer to the close or to giving up, what the server sent after the answer)."""
    start, data = time.monotonic(), b""
    while (waited := time.monotonic() - start) < TIMEOUT_S + 2:
        try:
            if select.select([sock], [], [], client.period_s)[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return time.monotonic() - start, data
                data += chunk
                continue
            sock.sendall(b"x" * client.piece)
        except OSError:  # reset: closed with some of what was sent unread
            return time.monotonic() - start, data
    return waited, data


def _check_unread_body(client: UnreadBody) -> None:
    path, declared = EARLY_ANSWERS[client.status]
    case = f"unread body: {client}"
    sock = _connect(client.after_a_response)
    try:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode() + b"x" * client.with_head)
        response = read_response(sock, closed_within_s=0.01)
        assert response is not None and response[0] == client.status, f"{case}: answered {response}"
        assert not response[3], f"{case}: the connection was closed with the answer (nothing left to check)"
        ended_s, after = _trickle_until_closed(sock, client)
    finally:
        sock.close()
    # The server's deadline starts as it sends the answer, a little before this client has read it.
    assert ended_s <= TIMEOUT_S + 1.0, f"{case}: the connection was held past the deadline ({ended_s:.2f} s)"
    assert ended_s >= TIMEOUT_S - 0.15, f"{case}: the connection ended after {ended_s:.2f} s"
    assert after == b"", f"{case}: the server wrote {after[:80]!r} after its answer"
    assert _connections_left(2) == 0, f"{case}: the server still holds the connection"


@settings(max_examples=30, deadline=None)
@given(delivery=st.one_of(DELIVERIES, UNREAD_BODIES))
def spec_a_head_arrives_in_time_or_its_connection_is_closed_at_the_deadline(delivery) -> None:
    if isinstance(delivery, UnreadBody):
        return _check_unread_body(delivery)
    (pieces, pauses, how), after_a_response = delivery
    case = (f"{how}{' after a response' if after_a_response else ''}: {len(pieces)} piece(s) after pauses "
            f"{[round(p, 2) for p in pauses]}")
    sock = _connect(after_a_response)
    try:
        ended_s, first_sent = _deliver(sock, pieces, pauses, how)
        data = b""
        if how == "in time":
            response = read_response(sock, closed_within_s=0.01)
            assert response is not None and response[0] == 200 and response[2] == b"ok", f"{case}: {response}"
        else:
            data = _until_closed(sock)
    except TimeoutError:
        raise AssertionError(f"{case}: the connection was held past the deadline ({ended_s:.2f} s)") from None
    finally:
        sock.close()
    if how != "in time":
        # After a response the server's deadline starts as it sends it, a little before this client has read it.
        earliest = TIMEOUT_S - (0.15 if after_a_response else 0.05)
        assert earliest <= ended_s <= TIMEOUT_S + 1.0, f"{case}: the connection ended after {ended_s:.2f} s"
        if first_sent is None:
            assert data == b"", f"{case}: nothing was sent, yet the server answered {data[:80]!r}"
        elif first_sent < TIMEOUT_S - 0.1:
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 "), f"{case}: part of a head came, answered {data[:80]!r}"
            assert json.loads(body)["error"]["code"] == "request_timeout", f"{case}: {body!r}"
    assert _connections_left(2) == 0, f"{case}: the server still holds the connection"


# ------------------------------------------------------------------------------------------ planted bugs
def _spec_fails(match: str) -> None:
    from specs.planted import _spec_fails as fails

    fails(spec_a_head_arrives_in_time_or_its_connection_is_closed_at_the_deadline, match)


def test_no_deadline_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's bug: no timer before a request is complete (uvicorn's own h11 protocol)."""
    monkeypatch.setattr(served().server.config.http_protocol_class, "_await_head", lambda self: None)
    _spec_fails("held past the deadline|ended after")


def test_a_deadline_moved_by_each_piece_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout per read (each piece of the head re-arms it), which a byte now and then passes."""
    protocol = served().server.config.http_protocol_class

    def rearmed(self) -> None:
        self._stop_head_timer()
        if self._awaits_head():
            self._head_timer = asyncio.get_running_loop().call_later(self.header_read_timeout_s, self._head_late)

    monkeypatch.setattr(protocol, "_await_head", rearmed)
    _spec_fails("^(trickled|unread body)")  # served, or closed later than its deadline


def test_a_body_unread_after_its_answer_without_a_deadline_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 30's review: the deadline only while h11 waits for a head, none for a body nobody reads after its
    early answer (the `_awaits_head` before `_body_unread`)."""
    protocol = served().server.config.http_protocol_class

    def head_only(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self._head_transport.is_closing()

    monkeypatch.setattr(protocol, "_awaits_head", head_only)
    _spec_fails("^unread body: .*held past the deadline")
