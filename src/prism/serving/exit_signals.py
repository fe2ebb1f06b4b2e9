"""SIGINT / SIGTERM abort the requests in flight before the server's own handler runs, so that a graceful shutdown
does not wait for streams that may run for the whole context."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from .async_engine import AsyncEngine


def abort_requests_on_exit_signals(async_engine: AsyncEngine) -> Callable[[], None]:
    """On SIGINT / SIGTERM, stop accepting and abort every request before the server's own handler runs (uvicorn's
    graceful shutdown waits for open responses to end, and a stream may run for the whole context: a SIGTERM with
    four streams in flight had not ended after 295 s). Each stream then ends with an error event and [DONE], new
    requests get a 503, and the shutdown goes on. Installed over the handlers in place (uvicorn's, which it sets
    before the app starts) when the server runs in the main thread; returns what puts them back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # (a server in a thread installs no handlers either)
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum, frame, previous=previous) -> None:
            async_engine.begin_shutdown()
            previous(signum, frame)

        signal.signal(sig, handler)
        installed.append((sig, previous, handler))

    def restore() -> None:
        for sig, previous, handler in installed:
            if signal.getsignal(sig) is handler:  # (uvicorn may have put its own back already)
                signal.signal(sig, previous)

    return restore
