"""Run a function on N CPU ranks (spawned processes over gloo) and collect what each returns.

For tests and reproducers of tensor parallelism: `run_ranks(fn, world, *args)` calls `fn(rank, init_method,
*args)` in `world` spawned processes (fn must be importable at module level, its result picklable by
torch.save) and returns the results in rank order. A rank that raises, or ranks still running after
`timeout_s` (a hung collective), make it raise `RanksFailed` with every rank's traceback; it never hangs.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..distributed.tensor_parallel import local_init_method


class RanksFailed(RuntimeError):
    """A rank raised, died, or the ranks did not finish in time."""


def _entry(rank: int, fn: Callable, init_method: str, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)
    returned = False
    try:
        torch.save(fn(rank, init_method, *args), Path(out_dir) / f"rank{rank}.pt")
        returned = True
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            if returned:
                # every rank done before any closes its connections: a gloo rank whose peer tears down first may
                # abort in C++ ("terminate called without an active exception", SIGABRT; seen once in CI)
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args, timeout_s: float = 120.0) -> list:
    """fn(rank, init_method, *args) on `world` spawned ranks; their return values in rank order."""
    env_before = os.environ.get("GLOO_SOCKET_IFNAME")
    if sys.platform.startswith("linux") and env_before is None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo picks its interface from the host name otherwise
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            ctx = mp.start_processes(_entry, args=(fn, local_init_method(), args, out_dir), nprocs=world,
                                     join=False, start_method="spawn")
            deadline = time.monotonic() + timeout_s
            try:
                while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                    if time.monotonic() >= deadline:
                        raise RanksFailed(f"ranks still running after {timeout_s} s (a hung collective?)")
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
                errs = "\n".join(p.read_text() for p in sorted(Path(out_dir).glob("*.err")))
                returned = [r for r in range(world) if (Path(out_dir) / f"rank{r}.pt").exists()]
                raise RanksFailed(f"a rank failed:\n{errs or error}\n(ranks that had returned their result: "
                                  f"{returned})") from error
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
        finally:
            if env_before is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
