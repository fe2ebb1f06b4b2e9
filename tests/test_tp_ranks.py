"""Two CPU ranks over gloo, one spawn for all: KV capacity agreement (invariant 10) through the real rank
set-up, and encoder data parallelism against the replicated encoder.

Capacity: ranks with different KV budgets both allocate the MIN page count; a rank whose budget holds no
page still joins, and then both ranks raise the same KVCapacityError (neither hangs: the spawn has a
deadline). Encoder DP: main and DeepStack features of 3 images of different sizes (more items than
ranks), of 1 image (fewer items than ranks), and one item at a time (deterministic mode) equal the
replicated encoder's, fp32, in the original item order. The step channel: a follower waits for rank 0's next step
for longer than the group's timeout (an idle engine), and takes the steps in order.
"""

from __future__ import annotations

import time

import pytest
import torch

from prism.distributed.capacity import KVCapacityError, agree_num_pages
from prism.distributed.encoder_dp import encode_media_items
from prism.distributed.step_channel import StepChannel
from prism.distributed.tensor_parallel import TPGroup, init_tp_group
from prism.engine.config import EngineConfig
from prism.engine.rank import build_rank_runner
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.ranks import run_ranks

WORLD = 2
BUDGETS = (1 << 20, 1 << 19)  # rank 1 has half rank 0's KV memory
ENCODER_CASES = {
    "3 items over 2 ranks": [(1, 4, 6), (1, 8, 8), (1, 2, 4)],
    "1 item over 2 ranks": [(1, 4, 4)],
    "4 equal items": [(1, 4, 4)] * 4,
}
FEATURE_ATOL = 1e-5


def _pixels(model, grids, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t * h * w, model.config.vision.patch_dim, generator=g) for t, h, w in grids]


def _rank(rank: int, init_method: str, ckpt: str) -> dict:
    group = init_tp_group(rank, WORLD, init_method, backend="gloo", timeout_s=60)
    out: dict = {"agreed": agree_num_pages(group, (5, 3)[rank])}
    base = EngineConfig(page_size=4, tensor_parallel_size=WORLD, check_invariants=True)
    config = base.replace(kv_memory_bytes=BUDGETS[rank])
    runner, max_model_len = build_rank_runner(ckpt, config, group)
    text = runner.model.config.text
    out["local_pages"] = config.kv_pages(text.num_hidden_layers, runner.layout.num_kv_heads, text.head_dim)
    out["pages"], out["pool_pages"] = runner.layout.num_pages, runner.gpu_pool.layout.num_pages
    out["max_model_len"] = max_model_len
    try:
        build_rank_runner(ckpt, base.replace(kv_memory_bytes=(1 << 20, 1)[rank]), group)
        out["zero"] = None
    except KVCapacityError as error:
        out["zero"] = str(error)
    model = runner.model  # the vision encoder is whole on every rank
    with torch.inference_mode():
        for i, (name, grids) in enumerate(ENCODER_CASES.items()):
            pixels = _pixels(model, grids, seed=i)
            for one_at_a_time in (False, True):
                dp = encode_media_items(model, grids, pixels, group, one_at_a_time=one_at_a_time)
                ref = encode_media_items(model, grids, pixels, TPGroup.single(), one_at_a_time=one_at_a_time)
                out[name, one_at_a_time] = {
                    "shapes": [(tuple(e.shape), tuple(d.shape)) for e, d in dp],
                    "ref_shapes": [(tuple(e.shape), tuple(d.shape)) for e, d in ref],
                    "diff": max(max((a - b).abs().max().item(), (c - d).abs().max().item())
                                for (a, c), (b, d) in zip(dp, ref, strict=True)),
                }
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank, WORLD, str(ensure_tiny_checkpoint()), timeout_s=120)


def test_agreement_is_the_min(ranks):
    assert [r["agreed"] for r in ranks] == [3, 3]


def test_ranks_with_different_budgets_allocate_the_min(ranks):
    local = [r["local_pages"] for r in ranks]
    assert local[0] > local[1] > 0, "the budgets must differ for this test to mean anything"
    assert [r["pages"] for r in ranks] == [min(local)] * WORLD
    assert ranks[0]["pool_pages"] == ranks[1]["pool_pages"]
    assert ranks[0]["max_model_len"] == ranks[1]["max_model_len"]


def test_a_rank_with_no_page_makes_every_rank_fail_the_same_way(ranks):
    messages = [r["zero"] for r in ranks]
    assert messages[0] is not None and messages[0] == messages[1]
    assert "no KV page fits" in messages[0]


@pytest.mark.parametrize("one_at_a_time", [False, True])
@pytest.mark.parametrize("name", list(ENCODER_CASES))
def test_encoder_data_parallel_equals_replicated(ranks, name, one_at_a_time):
    for r in ranks:
        res = r[name, one_at_a_time]
        assert res["shapes"] == res["ref_shapes"]
        assert res["diff"] <= FEATURE_ATOL, f"{name}: encoder DP differs from the replicated encoder by {res['diff']}"


CHANNEL_TIMEOUT_S = 2  # the group's timeout: gloo's receive timed out after it


def _idle_then_steps(rank: int, init_method: str) -> list:
    group = init_tp_group(rank, WORLD, init_method, backend="gloo", timeout_s=CHANNEL_TIMEOUT_S)
    channel = StepChannel(group)
    if rank == 0:
        time.sleep(2 * CHANNEL_TIMEOUT_S)  # idle: no step to send
        for step in ({"step": 1, "pixels": torch.arange(6.0)}, {"step": 2}, None):
            channel.send(lambda r, step=step: step)
        return []
    return [channel.recv() for _ in range(3)]


def test_a_follower_waits_for_the_next_step_longer_than_the_groups_timeout():
    """Found in session 31: a follower's receive of the next step timed out after the group's timeout
    (`distributed_timeout_s` on the CPU, 30 minutes for NCCL's gloo side group), so every follower of an engine idle
    that long exited and the next request failed (`reproducers/tp_idle_engine_lost_its_followers.py`)."""
    _, received = run_ranks(_idle_then_steps, WORLD, timeout_s=60)
    assert [r if r is None else r["step"] for r in received] == [1, 2, None]
    assert torch.equal(received[0]["pixels"], torch.arange(6.0))
