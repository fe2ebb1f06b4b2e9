"""Spec of tensor-parallel start-up, on the real code: every rank has a device, a dead follower is seen at once, and
the start returns only once every follower has finished its own.

Devices (`engine/rank.py`): for any device setting, tensor_parallel_size and count of CUDA devices, either every
rank runs on a device of its own that exists, rank 0 on the configured one, or `check_rank_devices` refuses the
config with a ConfigError naming the setting (`tensor_parallel_size`, or `device` for one rank), what it asks and
the devices there are; ranks on the CPU are never refused. Start-up waits (`engine/tp_startup.py`): for any schedule
of followers reporting a stage and exiting, on a simulated clock, rank 0's wait returns only once every follower has
reported while none has exited, and promptly; it fails within one poll of a follower's exit (and the polls that
`settled` adds to see the others failing with it), naming exactly the followers that exited and their exit codes;
and it gives up only once `timeout_s` has passed, naming the followers that never reported. The whole start (every
rank's real start-up code, followers as threads, a real store): for any follower killed or raising at any point of
its start (before each report, while loading, before each collective, after its KV pools, in its warm-up), rank 0's
start fails within seconds naming it and its exit code or error, every follower ended and the store dropped; with
none failing it returns only once every follower has finished; one killed after its start (idle) stops the ranks
(what `/health` reads) and fails the next step before it goes out.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from prism.distributed.capacity import allocate_kv_pools
from prism.engine import rank, tp_startup, tp_workers
from prism.engine.config import ConfigError, EngineConfig
from prism.testing.thread_ranks import ThreadRank, ThreadWorld

DEVICES = st.sampled_from(["cpu", "auto", "cuda"]) | st.integers(0, 7).map(lambda i: f"cuda:{i}")


@settings(max_examples=300, report_multiple_bugs=False)
@given(device=DEVICES, tp=st.integers(1, 8), count=st.integers(0, 8))
def spec_every_rank_has_its_own_device_or_the_config_is_refused(device: str, tp: int, count: int) -> None:
    config = EngineConfig(device=device, tensor_parallel_size=tp)
    with mock.patch.object(torch.cuda, "device_count", lambda: count), \
            mock.patch.object(torch.cuda, "is_available", lambda: count > 0):
        configured = config.resolved_device()
        try:
            rank.check_rank_devices(config)
            refused = None
        except Exception as error:  # noqa: BLE001 - what else it raises is the counterexample
            refused = error
        devices = [rank.rank_device(config, r) for r in range(tp)]
    case = f"device={device!r}, tensor_parallel_size={tp}, {count} CUDA device(s)"
    if refused is not None:
        assert isinstance(refused, ConfigError), f"{case}: refused with {refused!r}, not a ConfigError"
        message = str(refused)
        named = f"tensor_parallel_size={tp}" if tp > 1 else f"device={device!r}"
        assert named in message and f" {count} " in message, (
            f"{case}: the refusal must name the setting, what it asks and the devices there are: {message}")
        first = configured.index or 0 if configured.type == "cuda" else 0
        assert configured.type == "cuda" and first + tp > count, f"{case}: refused, though {message}"
        return
    assert devices[0].type == configured.type and (devices[0].index or 0) == (configured.index or 0), (
        f"{case}: rank 0 runs on {devices[0]}, not the configured {configured}")
    if configured.type == "cuda":  # one rank too: a device the host does not have is refused
        indices = [d.index or 0 for d in devices]
        assert len(set(indices)) == tp, f"{case}: ranks share a device: {devices}"
        assert all(i is not None and 0 <= i < count for i in indices), f"{case}: a rank's device is missing: {devices}"


# ------------------------------------------------------------------------------------------ start-up waits
POLL_S = 1.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Follower:
    clock: Clock
    reports_at: float | None  # when it reports the stage (None: never)
    exits_at: float | None  # when it exits (None: it lives)
    code: int

    def reported(self) -> bool:
        return self.reports_at is not None and self.clock.now >= self.reports_at

    @property
    def exitcode(self) -> int | None:
        return self.code if self.exits_at is not None and self.clock.now >= self.exits_at else None


MOMENTS = st.none() | st.integers(0, 48).map(lambda k: k / 4)  # quarter seconds: no float rounding at a poll
FOLLOWERS = st.lists(st.tuples(MOMENTS, MOMENTS, st.sampled_from([0, 1, 2, -9, -15])), min_size=1, max_size=4)


@settings(max_examples=400, report_multiple_bugs=False)
@given(schedule=FOLLOWERS, timeout_s=st.integers(0, 40).map(lambda k: k / 4), stage=st.sampled_from(sorted(tp_startup.STAGES)))
def spec_a_dead_follower_fails_the_wait_at_once_naming_it(schedule, timeout_s: float, stage: str) -> None:
    clock = Clock()
    followers = [Follower(clock, reports, exits, code) for reports, exits, code in schedule]
    case = f"followers (reports at, exits at, code) {schedule}, timeout {timeout_s} s"
    try:
        tp_startup.wait_for_followers(stage, lambda r: followers[r - 1].reported(), followers, timeout_s,
                                      clock=clock, sleep=clock.sleep, poll_s=POLL_S)
        failure = None
    except tp_startup.TensorParallelFailure as error:
        failure = str(error)
    now = clock.now
    dead = {r: f.code for r, f in enumerate(followers, 1) if f.exitcode is not None}
    first_exit = min((f.exits_at for f in followers if f.exits_at is not None), default=None)
    if failure is None:
        assert not dead, f"{case}: the wait returned at {now} s though rank(s) {sorted(dead)} had exited"
        assert all(f.reported() for f in followers), f"{case}: the wait returned at {now} s before every report"
        last = max(f.reports_at for f in followers)
        assert now < last + POLL_S, f"{case}: the wait returned at {now} s, the last report came at {last} s"
        return
    if dead:
        # seen within a poll, then the polls that let the others failing with it be seen too (`settled`)
        bound = first_exit + POLL_S + math.ceil(tp_startup.SETTLE_S / POLL_S) * POLL_S
        assert now < bound, f"{case}: a follower exited at {first_exit} s, the wait failed at {now} s"
        for r, code in dead.items():
            assert f"rank {r} exited with code {code}" in failure, f"{case}: the failure does not name rank {r}: {failure}"
        named = {int(part.split()[1]) for part in failure.split(": ", 1)[1].split("; ") if part.startswith("rank ")}
        assert named == set(dead), f"{case}: the failure names rank(s) {sorted(named)}, not those exited {sorted(dead)}"
        assert tp_startup.STAGES[stage] in failure, f"{case}: the failure does not say where: {failure}"
        return
    assert first_exit is None or first_exit > now, f"{case}: rank(s) exited at {first_exit} s, the wait went on"
    assert timeout_s <= now < timeout_s + POLL_S, f"{case}: the wait gave up at {now} s, its timeout is {timeout_s} s"
    waiting = [r for r, f in enumerate(followers, 1) if not f.reported()]
    assert waiting and f"rank(s) {waiting} had not" in failure, f"{case}: the timeout names {failure}, not {waiting}"


# ------------------------------------------------------------------ a follower failing at any point of its start
# The real start of every rank (`tp_workers.serve_worker` on the followers; `join_group` and `build_rank_0_runner`
# on rank 0; `rank.build_rank_runner` with the KV capacity agreement and pool allocation on each; the stages through a
# real store), the followers as threads: the model, its sharding and the runner's device work are stand-ins, the
# group's collectives those of `ThreadWorld`, whose collectives fail at once when a rank leaves, as gloo's do.
SIM_TIMEOUT_S = 20.0  # distributed_timeout_s: rank 0 must fail well within it
PROMPT_S = 5.0
STORE_SETTLE_S = 0.1
WARM_UP_S = 0.05  # a follower's warm-up takes time (a real one captures CUDA graphs): a start not waiting for it shows
POINTS = ("reporting joining", "loading", "reporting loaded", "collective 1", "collective 2", "collective 3",
          "collective 4", "collective 5", "after the pools", "warming up", "reporting ready", "idle")
_current = threading.local()


class Killed(BaseException):
    """The follower was killed at its drawn point: nothing of its own runs after (no report)."""


def _at(point: str) -> None:
    """A point of the start: the current thread's follower fails there if drawn to (rank 0's thread has none)."""
    follower = getattr(_current, "follower", None)
    if follower is not None and follower.fails_at == point:
        follower.fired = point
        if follower.kind == "killed":
            raise Killed(point)
        raise RuntimeError(f"planted at {point}")


class SimFollower:
    """A follower process: its thread runs the real `serve_worker`; what rank 0 sees of it is its exit code."""

    def __init__(self, rank: int, fails_at: str | None, kind: str, world: ThreadWorld) -> None:
        self.rank, self.fails_at, self.kind, self.world = rank, fails_at, kind, world
        self.fired: str | None = None
        self.exitcode: int | None = None
        self.pid = rank  # (`stop_followers` skips a process without one: never started)
        self.finished = threading.Event()  # its start finished (its runner built): set before it reports READY
        self.inbox: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None

    def start(self, address: str, config: dict) -> None:
        self.thread = threading.Thread(target=self._run, args=(address, config), daemon=True)
        self.thread.start()

    def _run(self, address: str, config: dict) -> None:
        _current.follower = self
        try:
            tp_workers.serve_worker(self.rank, address, "unused", config)
        except Killed:  # its exit is seen as its sockets close
            self._exit(-9)
        except BaseException:  # noqa: BLE001 - its exit code says it
            self._exit(1)
        else:
            self._exit(0)

    def _exit(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
        self.world.abort()  # its sockets close: a collective waiting on it fails at once

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def terminate(self) -> None:
        if self.exitcode is None:
            self.exitcode = -15
        self.world.abort()
        self.inbox.put(None)

    kill = terminate


class SimRank(ThreadRank):
    """A follower's group: each collective is a point of its start."""

    collectives = 0

    def min_int(self, value: int) -> int:
        self.collectives += 1
        _at(f"collective {self.collectives}")
        return super().min_int(value)


class SimChannel:
    def __init__(self, rank: int, followers: list[SimFollower]) -> None:
        self.rank, self.followers, self.sent = rank, followers, 0

    def send(self, payload_for) -> None:
        for f in self.followers:
            f.inbox.put(payload_for(f.rank))
        self.sent += 1

    def recv(self) -> object:
        _at("idle")
        return self.followers[self.rank - 1].inbox.get(timeout=SIM_TIMEOUT_S)


def _model(path, dtype, device):
    _at("loading")
    text = SimpleNamespace(num_key_value_heads=6, num_hidden_layers=1, head_dim=8)
    return SimpleNamespace(config=SimpleNamespace(text=text), device=device)


class SimRunner:
    def __init__(self, model, layout, num_cpu_pages, encoder_cache_bytes, *, group, kv_setting, **_) -> None:
        key, value = kv_setting
        self.pools = allocate_kv_pools(group, layout, torch.device("cpu"), num_cpu_pages, key=key, value=value)
        _at("after the pools")
        _at("warming up")
        follower = getattr(_current, "follower", None)
        if follower is not None:  # its start is done, but for its READY report (`rank.finish_start`)
            time.sleep(WARM_UP_S)
            follower.finished.set()

    def release_cuda_graphs(self) -> None:
        pass


def _reporting_points(report=tp_startup.FollowerRendezvous.reach):
    """A follower's report of each stage, a point of its start just before it."""
    def reach(self, stage: str) -> None:
        _at(f"reporting {stage}")
        report(self, stage)
    return reach


@contextlib.contextmanager
def _simulated(ranks: list[ThreadRank], followers: list[SimFollower]):
    world = len(ranks)
    with mock.patch.object(rank, "load_model", _model), \
            mock.patch.object(rank, "shard_text_decoder", lambda model, group: SimpleNamespace(num_kv_heads=6 // world)), \
            mock.patch.object(rank, "set_batch1_gemv", lambda *args, **kwargs: None), \
            mock.patch.object(rank, "ModelRunner", SimRunner), \
            mock.patch.object(tp_workers, "init_tp_group", lambda r, world_size, **kwargs: ranks[r]), \
            mock.patch.object(tp_workers, "StepChannel", lambda group: SimChannel(group.rank, followers)), \
            mock.patch.object(tp_startup.FollowerRendezvous, "reach", _reporting_points()), \
            mock.patch.object(torch, "set_num_threads", lambda n: None):
        yield


@settings(max_examples=60, deadline=None, report_multiple_bugs=False)
@given(world=st.integers(2, 3), data=st.data(), fails_at=st.none() | st.sampled_from(POINTS),
       kind=st.sampled_from(["killed", "raises"]), cpu_pages=st.sampled_from([0, 2]))
def spec_a_start_returns_only_once_every_follower_finished_its_own(world, data, fails_at, kind, cpu_pages) -> None:
    """Rank 0's start returns only once every follower has finished its start, none having failed; a follower
    killed or raising at any point of its start fails rank 0's start within `PROMPT_S`, naming the rank and its exit
    code or its error, every follower ended and the store dropped; one killed after the start (idle) makes the
    ranks stopped and the next step fail before it goes out."""
    failing = data.draw(st.integers(1, world - 1), label="failing rank")
    threads = ThreadWorld(world, timeout_s=SIM_TIMEOUT_S)
    ranks = [ThreadRank(0, world, threads)] + [SimRank(r, world, threads) for r in range(1, world)]
    followers = [SimFollower(r, fails_at if r == failing else None, kind, threads) for r in range(1, world)]
    config = EngineConfig(device="cpu", tensor_parallel_size=world, num_gpu_pages=4, page_size=4,
                          num_cpu_pages=cpu_pages, distributed_timeout_s=SIM_TIMEOUT_S)
    case = f"rank {failing} of {world} {kind} at {fails_at!r}, num_cpu_pages={cpu_pages}"
    rendezvous = tp_startup.Rendezvous(world, SIM_TIMEOUT_S)
    rendezvous.poll_s = 0.005
    rendezvous.processes = followers
    handle = None
    # A spawned follower connects to the store seconds after rank 0 made it (it imports torch first); one connecting
    # within milliseconds sometimes waits 5 s for torch's TCPStore client to retry (2 connections in 40 here).
    time.sleep(STORE_SETTLE_S)
    with _simulated(ranks, followers):
        try:
            for f in followers:
                f.start(rendezvous.address, config.to_dict())
            began = time.monotonic()
            try:
                try:
                    group, channel = tp_workers.join_group(0, config, rendezvous)
                except BaseException:
                    tp_workers.stop_followers(followers)  # as `launch_followers` does
                    rendezvous.close()
                    raise
                handle = tp_workers.Followers(followers, group, channel, rendezvous)
                tp_workers.build_rank_0_runner(handle, "unused", config)
                failure = None
            except tp_startup.TensorParallelFailure as error:
                failure = str(error)
            took = time.monotonic() - began
            me = followers[failing - 1]
            event(f"{'started' if failure is None else 'failed'}, rank {failing} {kind} at {me.fired}")
            if failure is None:
                unfinished = [f.rank for f in followers if not f.finished.is_set()]
                assert not unfinished, f"{case}: rank 0's start returned before rank(s) {unfinished} finished theirs"
                assert me.fired in (None, "idle"), f"{case}: rank 0's start returned though rank {failing} failed"
                if fails_at == "idle" and failing == me.rank:
                    _idle_death_is_noticed(handle, me, case)
                return
            # (one that finished its start and died at once, "idle", may fail the start too: rank 0 was still waiting)
            assert me.fired is not None, f"{case}: the start failed though no follower did: {failure}"
            assert took < PROMPT_S, f"{case}: rank 0's start took {took:.1f} s to fail"
            named = (f"rank {failing} exited with code -9 (SIGKILL)" if kind == "killed"
                     else f"rank {failing} failed: RuntimeError: planted at {me.fired}")
            assert named in failure, f"{case}: the failure does not name {named!r}: {failure}"
            for f in followers:
                f.join(PROMPT_S)
            assert not [f.rank for f in followers if f.is_alive()], f"{case}: a follower still runs after the start"
            assert rendezvous.store is None, f"{case}: the failed start kept its store"
        finally:
            if handle is not None:
                handle.close(timeout_s=PROMPT_S, graceful=False)
            for f in followers:
                f.terminate()
                f.join(PROMPT_S)


def _idle_death_is_noticed(followers: tp_workers.Followers, me: SimFollower, case: str) -> None:
    """A follower that died once the start returned: the ranks are stopped (what `/health` reads) and the next
    step fails before it goes out, naming it."""
    deadline = time.monotonic() + PROMPT_S
    while me.exitcode is None:
        assert time.monotonic() < deadline, f"{case}: the follower did not die"
        time.sleep(0.005)
    why = followers.why_stopped()
    assert why is not None and f"rank {me.rank} " in why, f"{case}: a dead follower, yet the ranks serve: {why}"
    try:
        followers.send(SimpleNamespace(for_rank=lambda r, world: None))
        raise AssertionError(f"{case}: a step went out to a dead follower")
    except tp_startup.TensorParallelFailure as error:
        assert f"rank {me.rank} " in str(error), f"{case}: the step's failure does not name rank {me.rank}: {error}"
    assert followers.channel.sent == 0, f"{case}: the step went out before its failure"
