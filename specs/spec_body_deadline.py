"""Spec of the request body's deadline (`serving/body_deadline.py`), over real HTTP: uvicorn in a thread, the tiny
checkpoint, raw sockets.

Invariant: a request whose body arrives whole within `body_read_timeout_s`, in however many pieces with whatever
pauses, is served; one whose body has not all arrived by then (part of it withheld, or trickled past the deadline) is
answered 408 at the deadline, its connection closed, and leaves nothing (no handler task, no engine request).
(The operator's review: a client that sent its headers and withheld its body held a connection and a handler for as
long as it kept the connection open.) Times are kept a margin away from the deadline on either side.
"""

from __future__ import annotations

import functools
import json
import select
import socket
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.serving.settings import ServerSettings
from prism.testing.serving import handlers_left_after, open_request, read_response, serve_in_thread

TIMEOUT_S = 0.6
MARGIN_S = 0.25
BODY = json.dumps({"model": "prism-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()


@functools.lru_cache(maxsize=1)
def served():
    return serve_in_thread(ServerSettings(body_read_timeout_s=TIMEOUT_S))  # a daemon thread: it ends with the process


@st.composite
def deliveries(draw, data: bytes = BODY):
    """(pieces of `data` (the body; `spec_header_deadline`: a request head), the pause before each, how it ends: "in
    time", "withheld" or "trickled"), paced against the deadline `TIMEOUT_S`."""
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=4)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    how = draw(st.sampled_from(["in time", "withheld", "trickled"]))
    if how == "trickled":
        total = TIMEOUT_S + MARGIN_S + draw(st.floats(0, 0.3))
    else:  # a withheld delivery's pieces before the one never sent may come at any pace
        total = draw(st.floats(0, TIMEOUT_S - MARGIN_S))
    weights = draw(st.lists(st.floats(0.01, 1), min_size=len(pieces), max_size=len(pieces)))
    return pieces, [total * w / sum(weights) for w in weights], how


def _deliver(sock: socket.socket, pieces: list[bytes], pauses: list[float], how: str) -> float:
    """Send the pieces after their pauses, until the server answers; the seconds from the headers to its answer (or
    to giving up on one)."""
    start = time.monotonic()
    for i, (piece, pause) in enumerate(zip(pieces, pauses, strict=True)):
        if select.select([sock], [], [], pause)[0]:
            return time.monotonic() - start  # answered before the body was in
        if how == "withheld" and i == len(pieces) - 1:
            break
        sock.sendall(piece)
    select.select([sock], [], [], TIMEOUT_S + 2)
    return time.monotonic() - start


@settings(max_examples=20, deadline=None)
@given(delivery=deliveries())
def spec_a_body_arrives_in_time_or_is_a_408_that_leaves_nothing(delivery) -> None:
    pieces, pauses, how = delivery
    server = served()
    sock = open_request(server.url, "/v1/chat/completions", len(BODY), timeout_s=TIMEOUT_S + 3)
    try:
        answered_s = _deliver(sock, pieces, pauses, how)
        response = read_response(sock)
    finally:
        sock.close()
    case = f"{how}: {len(pieces)} piece(s) after pauses {[round(p, 2) for p in pauses]}"
    assert response is not None, f"{case}: no answer {answered_s:.1f} s after the headers"
    status, headers, body, closed = response
    if how == "in time":
        assert status == 200 and json.loads(body)["choices"], f"{case}: {status} {body!r}"
    else:
        assert status == 408, f"{case}: {status} {body!r}, not a 408"
        assert json.loads(body)["error"]["code"] == "request_timeout", f"{case}: {body!r}"
        assert TIMEOUT_S - 0.05 <= answered_s <= TIMEOUT_S + 1.0, f"{case}: answered after {answered_s:.2f} s"
        assert closed and headers.get("connection") == "close", f"{case}: the connection stayed open"
    tasks, requests = handlers_left_after(server, 3)
    assert not tasks and not requests, f"{case}: left behind: {tasks} handler task(s), engine requests {requests}"
