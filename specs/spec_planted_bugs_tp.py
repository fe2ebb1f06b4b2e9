"""Proof that the tensor-parallel specs bite: each historical bug of the ranks' KV capacity, their devices, the
start-up wait and encoder DP, planted.

Each test monkeypatches one buggy variant into the real component and requires the spec that owns the invariant to
fail (see `specs/planted.py`).
"""

from __future__ import annotations

import pytest

from specs.planted import _spec_fails


def test_each_rank_using_its_own_page_count_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical: every TP rank sized its KV pool from its own free memory, so page ids rank 0 handed out
    pointed past a smaller rank's pool (divergent KV), and a rank without room left the others hanging."""
    from prism.distributed import capacity
    from specs import spec_tp_capacity

    def own_pages(group, local_pages):
        if local_pages < 1:
            raise capacity.KVCapacityError("no KV page fits on this rank")
        return local_pages

    monkeypatch.setattr(capacity, "agree_num_pages", own_pages)
    _spec_fails(spec_tp_capacity.spec_every_rank_uses_the_min_or_all_fail_together, "disagree|not the MIN")


def test_too_few_cuda_devices_failing_at_the_launch_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (review of the TP start-up): too few CUDA devices for tensor_parallel_size was a
    TensorParallelFailure raised at the followers' launch, not a ConfigError."""
    import torch

    from prism.engine import rank, tp_workers
    from specs import spec_tp_startup

    def check_as_before(config):
        tp = config.tensor_parallel_size
        if config.resolved_device().type == "cuda" and torch.cuda.device_count() < tp:
            raise tp_workers.TensorParallelFailure(f"tensor_parallel_size={tp} needs {tp} CUDA devices, found "
                                                   f"{torch.cuda.device_count()}")

    monkeypatch.setattr(rank, "check_rank_devices", check_as_before)
    _spec_fails(spec_tp_startup.spec_every_rank_has_its_own_device_or_the_config_is_refused, "not a ConfigError")


def test_ranks_ignoring_the_configured_cuda_device_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (review of the TP start-up): the ranks took cuda:0.. whatever device was configured
    (device='cuda:1' put rank 0 on cuda:0), and the device check counted from cuda:0."""
    import torch

    from prism.engine import rank
    from specs import spec_tp_startup

    def device_as_before(config, r):
        device = config.resolved_device()
        return torch.device("cuda", r) if device.type == "cuda" and config.tensor_parallel_size > 1 else device

    monkeypatch.setattr(rank, "rank_device", device_as_before)
    _spec_fails(spec_tp_startup.spec_every_rank_has_its_own_device_or_the_config_is_refused, "not the configured")


def test_a_start_up_wait_blind_to_dead_followers_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (review of the TP start-up): rank 0 waited for the followers inside torch.distributed (the
    rendezvous, the first collective), which sees only their check-ins: a follower dead before it checked in kept
    rank 0 waiting `distributed_timeout_s` (300 s by default). The wait that never looks at the processes is that."""
    from prism.engine import tp_startup
    from specs import spec_tp_startup

    def reports_only(processes, error_of=tp_startup.no_errors):  # the followers' reported errors, not their exits
        return [f"rank {r} failed: {error}" for r in range(1, len(processes) + 1) if (error := error_of(r))]

    monkeypatch.setattr(tp_startup, "failed", reports_only)
    _spec_fails(spec_tp_startup.spec_a_dead_follower_fails_the_wait_at_once_naming_it,
                "does not name rank|had exited|a follower exited at")


def test_a_start_returning_before_its_followers_finished_theirs_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Historical (session 30): the ranks' last meeting in the start was the KV pools' agreement, so rank 0's start
    returned an engine whose follower had died after its pools (or failed in its warm-up) and nothing noticed until
    the first step. The start without its final READY report and wait (`rank.finish_start`) is that."""
    from prism.engine import rank
    from specs import spec_tp_startup

    monkeypatch.setattr(rank, "finish_start", lambda reach: None)
    _spec_fails(spec_tp_startup.spec_a_start_returns_only_once_every_follower_finished_its_own, "start returned")


def test_encoder_dp_losing_the_item_order_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoder DP that returns the gathered features in rank order instead of the original media order."""
    from prism.distributed import encoder_dp
    from specs import spec_tp_capacity

    encode = encoder_dp.encode_media_items

    def rank_ordered(model, grids, pixels, group, *, one_at_a_time=False):
        out = encode(model, grids, pixels, group, one_at_a_time=one_at_a_time)
        owner = encoder_dp.assign_media([t * h * w for t, h, w in grids], group.world_size)
        return [out[i] for i in sorted(range(len(out)), key=lambda i: (owner[i], i))]

    monkeypatch.setattr(encoder_dp, "encode_media_items", rank_ordered)
    _spec_fails(spec_tp_capacity.spec_encoder_dp_equals_the_replicated_encoder, "order lost")
