"""Spec of tensor-parallel start-up, on the real code: every rank has a device, and a dead follower is seen at once.

Devices (`engine/rank.py`): for any device setting, tensor_parallel_size and count of CUDA devices, either every
rank runs on a device of its own that exists, rank 0 on the configured one, or `check_rank_devices` refuses the
config with a ConfigError naming the setting (`tensor_parallel_size`, or `device` for one rank), what it asks and
the devices there are; ranks on the CPU are never refused. Start-up waits (`engine/tp_startup.py`): for any schedule of followers reporting a stage and
exiting, on a simulated clock, rank 0's wait returns only once every follower has reported while none has exited,
and promptly; it fails within one poll of a follower's exit, naming exactly the followers that exited and their
exit codes; and it gives up only once `timeout_s` has passed, naming the followers that never reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.engine import rank, tp_startup
from prism.engine.config import ConfigError, EngineConfig

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
        assert now < first_exit + POLL_S, f"{case}: a follower exited at {first_exit} s, the wait failed at {now} s"
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
