"""Two CPU ranks over gloo, one spawn for all: KV capacity agreement (invariant 10) through the real rank
set-up, and encoder data parallelism against the replicated encoder.

Capacity: ranks with different KV budgets both allocate the MIN page count; a rank whose budget holds no
page still joins, and then both ranks raise the same KVCapacityError (neither hangs: the spawn has a
deadline). Encoder DP: main and DeepStack features of 3 images of different sizes (more items than
ranks), of 1 image (fewer items than ranks), and one item at a time (deterministic mode) equal the
replicated encoder's, fp32, in the original item order.
"""

from __future__ import annotations

import pytest
import torch

from prism.distributed.capacity import KVCapacityError, agree_num_pages
from prism.distributed.encoder_dp import encode_media_items
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
