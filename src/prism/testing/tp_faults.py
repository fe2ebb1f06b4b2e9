"""Follower ranks that die during tensor-parallel start-up, for the tests and reproducers of `engine/tp_startup.py`.

Each fault is a stand-in for `tp_workers.serve_worker` (a module-level function, so a spawned process can import
it): rank 1 dies at the named point of its start-up, any other rank serves as usual. `dying_follower(fault)`
makes the engines built inside it spawn that stand-in.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


def _kill_myself(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_loading(*args, **kwargs) -> None:
    raise RuntimeError("planted: rank 1 could not load its model")


def killed_before_joining(rank: int, address: str, model_dir: str, config: dict) -> None:
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        _kill_myself()
    serve_worker(rank, address, model_dir, config)


def raises_while_loading(rank: int, address: str, model_dir: str, config: dict) -> None:
    from ..engine import rank as rank_setup
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        rank_setup.load_model = _fail_loading
    serve_worker(rank, address, model_dir, config)


def killed_while_loading(rank: int, address: str, model_dir: str, config: dict) -> None:
    from ..engine import rank as rank_setup
    from ..engine.tp_workers import serve_worker

    if rank == 1:
        rank_setup.load_model = _kill_myself
    serve_worker(rank, address, model_dir, config)


FAULTS = {f.__name__: f for f in (killed_before_joining, raises_while_loading, killed_while_loading)}


@contextlib.contextmanager
def dying_follower(fault: str) -> Iterator[None]:
    """Engines built inside spawn `FAULTS[fault]` as their followers."""
    from ..engine import tp_workers

    serve = tp_workers.serve_worker
    tp_workers.serve_worker = FAULTS[fault]
    try:
        yield
    finally:
        tp_workers.serve_worker = serve


def live_followers() -> list[str]:
    """The names of this process's follower ranks still running (reaping those that ended)."""
    import multiprocessing

    return [p.name for p in multiprocessing.active_children() if p.name.startswith("prism-tp-rank")]
