"""The request head's deadline: a connection that does not deliver a whole request head (request line and headers)
within `ServerSettings.header_read_timeout_s` of being ready for one is closed (slowloris before the body).

Owns *a request head arrives whole in time, or its connection is closed*: the deadline starts when the connection
opens and again when a response completes (a kept-alive connection ready for its next request), and is not moved by
the bytes that arrive meanwhile, so a client trickling a byte now and then gets no more time than one sending nothing.
A connection that sent part of a head is answered 408 before it is closed; one that sent nothing is just closed (as
uvicorn closes an idle kept-alive connection), and so is one still sending a body its answer did not wait for (a 404,
a 413 from the declared length), from when that answer was sent. Once the head is in, the app has the request and `body_deadline.py`
times its body.

uvicorn (0.55, which this was written against) has no such setting: its h11 protocol starts no timer before a request
is complete, and its keep-alive timer stops at the first byte of the next request. `header_deadline_protocol` is its
`H11Protocol` with the deadline, for `uvicorn.run(..., http=...)` (what `prism serve` and
`testing.serving.serve_in_thread` run); the uvicorn command takes it as `--http prism.serving.header_deadline:
H11Protocol` (this module's `H11Protocol`, made from PRISM_HEADER_READ_TIMEOUT_S when uvicorn imports it; without that
flag there is no deadline). It relies on uvicorn keeping the request's h11 state in `self.conn` (an `h11.Connection`,
whose `their_state` and `trailing_data` are h11's public API) and calling the hooks it overrides: both are checked when
the class is made, so that another uvicorn fails the start with an error that says so, rather than serving without a
deadline.
"""

from __future__ import annotations

import asyncio
import json

import h11

from .responses import error_body

HOOKS = ("connection_made", "data_received", "on_response_complete", "connection_lost")


def request_timeout_response(timeout_s: float) -> bytes:
    """The raw 408 a connection gets when part of a request head came but not all of it in time."""
    body = json.dumps(error_body(408, f"the request head (request line and headers) did not arrive within "
                                      f"{timeout_s:g} s; send it whole, without pauses")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def header_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's `H11Protocol` closing a connection whose request head is not all in within `timeout_s` of its being
    ready for one. RuntimeError, naming uvicorn's version, if the installed uvicorn does not have what it relies on."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise ValueError(f"the request head's timeout must be a finite number of seconds > 0, got {timeout_s!r}")
    uvicorns = [c for c in H11Protocol.__mro__ if c not in asyncio.Protocol.__mro__]  # asyncio's hooks do nothing
    missing = [name for name in HOOKS if not any(callable(vars(c).get(name)) for c in uvicorns)]
    if missing:
        raise _unfit(uvicorn.__version__, f"its H11Protocol has no {', '.join(missing)}")
    timeout_response = request_timeout_response(timeout_s)

    class HeaderDeadlineH11Protocol(H11Protocol):
        header_read_timeout_s = float(timeout_s)

        def connection_made(self, transport) -> None:
            self._head_transport, self._head_timer = transport, None
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._await_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _awaits_head(self) -> bool:
            """Whether the connection waits for (the rest of) a request head: h11 has not had one since the
            connection opened or the last request-response cycle ended; or for the rest of a body nobody reads,
            its response already sent (a 404, a 413 from the declared length): the body's deadline is the app's
            reading it, so without this a byte now and then would hold the connection."""
            if self._head_transport.is_closing():
                return False
            return self.conn.their_state is h11.IDLE or self._body_unread()

        def _body_unread(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY and self.conn.our_state in (h11.DONE, h11.MUST_CLOSE)

        def _await_head(self) -> None:
            if not self._awaits_head():
                self._stop_head_timer()
            elif self._head_timer is None:  # armed once per head: the bytes that come do not move it
                self._head_timer = asyncio.get_running_loop().call_later(self.header_read_timeout_s, self._head_late)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if not self._awaits_head():
                return
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head: say why
                self._head_transport.write(timeout_response)
            self._head_transport.close()

    _check_fits(HeaderDeadlineH11Protocol, uvicorn)
    return HeaderDeadlineH11Protocol


def _check_fits(protocol: type, uvicorn) -> None:
    """Make one protocol object as uvicorn's server makes them (no connection): it must keep its h11 state in
    `conn`."""
    from uvicorn.server import ServerState

    async def no_app(scope, receive, send) -> None:  # never called: the probe has no connection
        raise RuntimeError("the header deadline's probe has no requests")

    loop = asyncio.new_event_loop()
    try:  # log_config=None: the probe's Config configures no logging
        probe = protocol(config=uvicorn.Config(no_app, log_config=None), server_state=ServerState(), app_state={},
                         _loop=loop)
        conn = getattr(probe, "conn", None)
    except Exception as error:
        raise _unfit(uvicorn.__version__, f"making its H11Protocol failed ({type(error).__name__}: {error})") from error
    finally:
        loop.close()
    if not isinstance(conn, h11.Connection):
        raise _unfit(uvicorn.__version__, f"its H11Protocol keeps no h11.Connection in .conn (got {type(conn).__name__})")


def _unfit(version: str, why: str) -> RuntimeError:
    return RuntimeError(f"the request head's deadline (PRISM_HEADER_READ_TIMEOUT_S) does not fit uvicorn {version}: "
                        f"{why}. Install a uvicorn it fits (it was written against 0.55), or serve behind a reverse "
                        "proxy with a header timeout")


def __getattr__(name: str):
    """`H11Protocol`: the deadline's protocol with PRISM_HEADER_READ_TIMEOUT_S (uvicorn's `--http` imports it)."""
    if name == "H11Protocol":
        from .settings import ServerSettings

        return header_deadline_protocol(ServerSettings.from_env().header_read_timeout_s)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
