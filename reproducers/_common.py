"""Shared by the reproducers: make `prism` importable from a checkout and report a verdict."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "src", ROOT):  # the package, and the specs whose harnesses some reproducers reuse
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def verdict(ok: bool, fixed: str, broken: str) -> None:
    if ok:
        print(f"OK: {fixed}")
        sys.exit(0)
    print(f"BUG: {broken}", file=sys.stderr)
    sys.exit(1)


def liveness_verdict(requests, arrivals, what: str, **run_kwargs) -> None:
    """Run the liveness spec's scheduler harness on one fixed case; every request must terminate."""
    from specs.spec_scheduler_liveness import run

    try:
        stats = run(requests, arrivals, cancels={}, **run_kwargs)
        ok, detail = True, f"{stats['steps']} steps, {stats['preemptions']} preemption(s)"
    except AssertionError as error:
        ok, detail = False, str(error)
    verdict(ok, f"{what} ({detail})", detail)


def serve_in_thread(settings, **uvicorn_config):
    """The real app (`create_app(settings)`) under uvicorn on a free local port, in a daemon thread: (app, server,
    base url). Stop it with `server.should_exit = True`."""
    import socket
    import threading
    import time

    import uvicorn

    from prism.serving.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **{"log_level": "warning",
                                                                                 **uvicorn_config}))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return app, server, f"http://127.0.0.1:{port}"


def requests_left_after(engine, seconds: float) -> list[str]:
    """The engine's requests still there after waiting up to `seconds` for them to go."""
    import time

    deadline = time.time() + seconds
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    return list(engine.requests)
