"""Tensor-parallel follower ranks: spawning them, their serving loop, and failing together.

Owns *rank 0 schedules, followers follow, and a failed rank fails every rank*. The engine (rank 0) spawns
ranks 1..tp-1 (`launch_followers`, vLLM-style: the user only sets tensor_parallel_size); each follower
sets itself up exactly as rank 0 does (`rank.build_rank_runner`) and then runs every step payload rank 0
broadcasts, in order, until a None payload (`serve_worker`). Every collective is bounded by
`distributed_timeout_s`, and a rank-0 error names the followers that died (and the error a follower reported), so
nothing hangs silently; while the ranks start, rank 0 watches the followers live at each stage up to the end of
their start (`tp_startup`), so one that dies or raises fails it at once; after it, a follower that died while the
engine was idle fails the next step before its payload goes out, and stops the engine (`Followers.check_alive`,
`Followers.why_stopped`: what `/health` reads).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.step_channel import StepChannel
from ..distributed.tensor_parallel import TPGroup, init_tp_group
from .config import EngineConfig
from .rank import build_rank_runner, check_rank_devices, rank_device
from .runner import ModelRunner
from .step_payload import StepPayload
from .tp_startup import JOINING, FollowerRendezvous, Rendezvous, TensorParallelFailure, failed

log = logging.getLogger(__name__)


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.resolved_device().type == "cuda" else "gloo"


def join_group(rank: int, config: EngineConfig, rendezvous: Rendezvous | FollowerRendezvous
               ) -> tuple[TPGroup, StepChannel]:
    """Join the TP group (every rank, the same way, through rank 0's store) and open the step channel. Rank 0
    waits at JOINING until every follower is there, watching that they live (`tp_startup`)."""
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rendezvous.reach(JOINING)
    group = init_tp_group(rank, config.tensor_parallel_size, store=rendezvous.store, backend=_backend(config),
                          timeout_s=config.distributed_timeout_s)
    return group, StepChannel(group)


def serve_worker(rank: int, address: str, model_dir: str, config: dict) -> None:
    """A follower rank's whole life: join through rank 0's store at `address`, set up like rank 0, run rank 0's
    steps until told to stop."""
    cfg = EngineConfig.from_dict(config)
    if cfg.resolved_device().type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tensor_parallel_size))
    rendezvous = FollowerRendezvous(rank, address, cfg.distributed_timeout_s)
    runner = None
    try:
        with rendezvous.reporting():  # rank 0 learns this rank's error before the group is left (its start fails)
            group, channel = join_group(rank, cfg, rendezvous)
            runner, _ = build_rank_runner(model_dir, cfg, group, reach=rendezvous.reach)  # ends reporting READY
            while (payload := channel.recv()) is not None:
                runner.run(payload)
    finally:
        leave_group(runner.release_cuda_graphs if runner is not None else None, cfg.distributed_timeout_s)


@dataclass
class Followers:
    """Rank 0's handle on the follower processes."""

    processes: list[multiprocessing.process.BaseProcess]
    group: TPGroup
    channel: StepChannel
    rendezvous: Rendezvous  # rank 0's store; `reach` waits for every follower at a start-up stage
    release_graphs: Callable[[], None] | None = None  # rank 0's runner's, once it has one (`leave_group`)
    leave_timeout_s: float = 30.0
    closed: bool = field(default=False)

    def send(self, payload: StepPayload) -> None:
        """Each follower gets the step as it needs it (only the pixels of the items it encodes)."""
        if self.closed:
            raise TensorParallelFailure("this engine's tensor-parallel ranks were stopped (the engine was shut down, "
                                        "or a step failed): build a new engine")
        self.check_alive()
        world = self.group.world_size
        try:
            self.channel.send(lambda rank: payload.for_rank(rank, world))
        except Exception as error:
            raise self.failure(error) from error

    def check_alive(self) -> None:
        """Raise `TensorParallelFailure` naming the followers that have exited (one died while the engine was idle):
        a step must not go out to ranks that will not run it, where rank 0 would learn it inside the step's
        collectives (under NCCL, when `distributed_timeout_s` runs out). A poll of the processes' exit codes."""
        if failed(self.processes):
            raise TensorParallelFailure(f"tensor-parallel rank(s) gone before this step went out (died while the "
                                        f"engine was idle or between steps): "
                                        f"{'; '.join(failed(self.processes, self.rendezvous.error_of))}; every rank "
                                        "is stopped: build a new engine")

    def why_stopped(self) -> str | None:
        """Why these ranks can serve no more (closed, or a follower has exited), None while they can. A poll of the
        exit codes only: safe from another thread than the engine's (`/health`)."""
        if self.closed:
            return "the engine was shut down, or a step failed"
        dead = failed(self.processes)
        return '; '.join(dead) if dead else None

    def failure(self, error: BaseException, during: str = "step") -> TensorParallelFailure:
        """A clear error for a collective that failed on rank 0 (`during` a step, or the engine's start), naming
        the followers that exited or reported an error (waiting a moment to learn it: `Rendezvous.failures_within`)."""
        dead = self.rendezvous.failures_within()
        why = "; ".join(dead) if dead else "all followers still running"
        return TensorParallelFailure(f"tensor-parallel {during} failed on rank 0 ({why}): {type(error).__name__}: "
                                     f"{error}")

    def close(self, timeout_s: float = 30.0, graceful: bool = True) -> bool:
        """Tell the followers to stop, leave the group, wait for them. Idempotent. False if leaving the group
        did not finish in time (`leave_group`). `graceful=False` (rank 0 failed, at start or inside a step): the
        followers are terminated instead, since one inside the lost step's collectives would not take the stop
        message until `distributed_timeout_s` (300 s by default) ran out; so are they when one has already exited
        (the others wait for their next step with no time limit, `StepChannel.recv`, and would get no message)."""
        if self.closed:
            return True
        self.closed = True
        left = False
        try:
            try:
                if graceful and not failed(self.processes):
                    self.channel.send(lambda rank: None)
                else:
                    for p in self.processes:
                        p.terminate()
            except Exception:  # a follower is already gone: nothing left to tell
                log.warning("tensor-parallel shutdown: a follower did not take the stop message", exc_info=True)
            release, self.release_graphs = self.release_graphs, None  # it refers to the runner, which refers to us
            left = leave_group(release, self.leave_timeout_s)
        finally:
            for p in self.processes:
                p.join(timeout_s)
                if p.is_alive():
                    p.terminate()
                    p.join(5)
            self.rendezvous.close()  # its store listens on a port while it lives
        return left


def leave_group(release_graphs: Callable[[], None] | None, timeout_s: float) -> bool:
    """This rank's exit from the TP group, the same on every rank: first destroy its CUDA graphs, then abort its
    communicators, within `timeout_s`. False (logged) if the abort did not return in time.

    The order is the fix of a hang seen on two H200s (NCCL 2.28, torch 2.11): a graph that captured an NCCL
    collective holds a reference on the communicator, and NCCL's teardown, destroy and abort alike, waits until
    every such graph is destroyed, so both ranks waited forever with the decode graphs alive. Abort rather than
    destroy: it does not wait on peers, and after the stop message (or a follower's death) none will come. The
    bound keeps a rank from hanging where something else still pins a communicator (NCCL's abort releases the
    GIL). No device synchronize here: a collective stuck in a graph replay (a peer died mid-step) only ends by the
    abort, and a graph reset while its replay runs is freed once the replay ends."""
    if release_graphs is not None:
        try:
            release_graphs()
        except Exception:  # a sticky CUDA error, say: leaving the group matters more
            log.exception("destroying the CUDA graphs before leaving the tensor-parallel group failed")
    if not dist.is_initialized():
        return True
    done = threading.Event()

    def abort() -> None:
        try:
            abort_process_group()
        finally:
            done.set()

    try:
        threading.Thread(target=abort, daemon=True, name="prism-tp-leave").start()
    except RuntimeError:  # at interpreter exit (weakref.finalize) Python 3.12 starts no thread: abort inline
        abort()
    if done.wait(timeout_s):
        return True
    log.error("leaving the tensor-parallel group did not finish within %.0f s; going on without it", timeout_s)
    return False


def abort_process_group() -> None:
    """Leave the default group without waiting on its peers (torch's private abort where it has one)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
            return
    except Exception:  # a backend without abort (gloo in some versions): destroy, which does not wait on peers there
        log.warning("aborting the tensor-parallel group failed; destroying it", exc_info=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_followers(model_dir: str | Path, config: EngineConfig) -> Followers:
    """Spawn ranks 1..tp-1 and join the group as rank 0. A follower that dies before it joins fails the start at once
    (`tp_startup`); one that dies in the moment between joining and the group's forming costs torch's own wait,
    `distributed_timeout_s`. On any failure here every follower is stopped and the group, formed or half-formed, is
    forgotten (`forget_process_group`) before it raises."""
    tp = config.tensor_parallel_size
    check_rank_devices(config)
    if dist.is_initialized():
        raise TensorParallelFailure("torch.distributed is already initialized in this process (one TP engine at a time)")
    if sys.platform.startswith("linux"):
        # Every rank is on this host: gloo (the backend on CPU, the step channel's side group beside NCCL) and
        # NCCL's bootstrap talk over loopback, whatever the host name resolves to. On a host whose name resolves
        # to an address nothing listens on (a VM without a network), the side group's connect hung the TP2 start.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    rendezvous = Rendezvous(tp, config.distributed_timeout_s)
    ctx = multiprocessing.get_context("spawn")
    processes = [
        ctx.Process(target=serve_worker, args=(rank, rendezvous.address, str(model_dir), config.to_dict()), daemon=True,
                    name=f"prism-tp-rank{rank}")
        for rank in range(1, tp)
    ]
    rendezvous.processes = processes
    try:
        for p in processes:
            p.start()
        group, channel = join_group(0, config, rendezvous)
    except BaseException as error:
        stop_followers(processes)
        forget_process_group()
        rendezvous.close()
        if isinstance(error, TensorParallelFailure) or not isinstance(error, Exception):
            raise
        raise TensorParallelFailure(f"could not form the tensor-parallel group of {tp}: {error}") from error
    return Followers(processes, group, channel, rendezvous)


def build_rank_0_runner(followers: Followers, model_dir: str | Path, config: EngineConfig) -> tuple[ModelRunner, int]:
    """Rank 0's start once the group formed: `rank.build_rank_runner`, which returns only once every follower has
    finished its own start (READY). On a failure every follower is stopped and rank 0 raises a
    `TensorParallelFailure` naming the followers that failed and their errors (a failed wait's own, or one made from
    the collective that broke), or, for a configuration problem every rank agreed on (a `KVCapacityError`), that
    error itself once the followers were told to stop."""
    try:
        return build_rank_runner(model_dir, config, followers.group, reach=followers.rendezvous.reach)
    except Exception as error:
        agreed = isinstance(error, ValueError)  # a configuration problem every rank agreed on (capacity)
        # (only a failure not agreed looks for a follower to name: that waits up to FAILURE_GRACE_S)
        failure = error if agreed or isinstance(error, TensorParallelFailure) else followers.failure(error, "start")
        followers.close(graceful=agreed)  # else the followers may wait inside a collective: stopped
        if failure is error:
            raise
        raise failure from error


def forget_process_group() -> None:
    """Leave no trace of a group this process began to form, so that another TP engine can start in it: abort the
    group if it formed (it failed after, e.g. the step channel's side group waiting for a follower that died after
    joining); else undo torch's count of the group whose forming failed, as destroying it would have (the next
    group's name, hence its store keys, would differ from those of fresh followers: a start waiting out its
    timeout)."""
    if dist.is_initialized():
        abort_process_group()
        return
    world = getattr(dist.distributed_c10d, "_world", None)  # private: kept only where it is as in torch 2.11-2.13
    if world is not None and isinstance(getattr(world, "group_count", None), int):
        world.group_count = 0


def stop_followers(processes: list[multiprocessing.process.BaseProcess], timeout_s: float = 5.0) -> None:
    """Terminate the followers that run and reap every one (a start-up's failure: none can go on)."""
    for p in processes:
        if p.pid is not None and p.exitcode is None:
            p.terminate()
    for p in processes:
        if p.pid is None:
            continue
        p.join(timeout_s)
        if p.exitcode is None:
            p.kill()
            p.join()
