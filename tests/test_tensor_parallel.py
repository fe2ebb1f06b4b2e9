"""TP == TP1 for the text decoder: two CPU ranks over gloo against the unsharded model, fp32.

Each spawned rank loads the tiny checkpoints, computes the media features with the full
(replicated) vision encoder, shards the decoder and runs one packed batch (a 1-image prompt and a
text-only prompt) through the dense backend, then 16 greedy steps. Rank 0 also runs the unsharded
model first. The parent checks: logits within 1e-5 of TP1 on every row, identical greedy tokens,
bitwise-identical logits on both ranks (each rank may sample on its own), the shard shapes the
attention backend saw, and `min_int`. Indivisible head counts are checked without processes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prism.distributed.tensor_parallel import (
    TensorParallelError,
    TPGroup,
    init_tp_group,
    plan_text_shard,
    shard_text_decoder,
)
from prism.model.attention import DenseCausalAttention
from prism.model.config import Qwen3VLConfig
from prism.model.loading import load_model
from prism.model.mrope import decode_positions, mrope_positions
from prism.model.qwen3_vl import MultimodalEmbeddings, Qwen3VLModel, last_token_indices
from prism.testing.checkpoints import ensure_checkpoint, ensure_tiny_checkpoint
from prism.testing.ranks import run_ranks

WORLD = 2
GREEDY_STEPS = 16
# fp32: 1e-5 absolute, or 1e-6 of the largest |logit| if that is larger: the tied checkpoint's logits
# reach ~80 (hidden states ~20x the untied ones), where one fp32 ulp is 7.6e-6, and the reordered
# row-parallel partial sums move every logit by a few ulp of that scale.
ATOL, REL_OF_MAX = 1e-5, 1e-6


def assert_tp_close(tp: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert tp.shape == ref.shape, what
    tol = max(ATOL, REL_OF_MAX * ref.abs().max().item())
    diff = (tp - ref).abs().max().item()
    assert diff <= tol, f"{what}: TP2 logits differ from TP1 by {diff:.3g} > {tol:.3g}"


JOIN_TIMEOUT_S = 120.0  # a hung collective fails the test instead of hanging CI
COLLECTIVE_TIMEOUT_S = 60.0
MIN_INT_INPUTS = ((7, 3), (0, 5))  # per round: (rank 0's value, rank 1's value)


class RecordingDense(DenseCausalAttention):
    """The dense backend, unchanged, recording the head counts it is handed."""

    def __init__(self, seq_lens):
        super().__init__(seq_lens)
        self.shapes: set[tuple[int, int, int]] = set()

    def attend(self, layer_idx, q, k, v):
        self.shapes.add((q.shape[1], k.shape[1], v.shape[1]))
        return super().attend(layer_idx, q, k, v)


def _prompts(model: Qwen3VLModel):
    """A packed batch: [image prompt, text prompt] with positions and precomputed media features."""
    cfg = model.config
    g = torch.Generator().manual_seed(11)
    grid = (1, 4, 6)  # patches; 6 LM tokens after the 2x2 merge
    n_img = grid[1] * grid[2] // cfg.vision.spatial_merge_size**2
    low = min(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
    text = lambda n: torch.randint(0, low, (n,), generator=g).tolist()  # noqa: E731
    img_ids = (
        text(3)
        + [cfg.vision_start_token_id]
        + [cfg.image_token_id] * n_img
        + [cfg.vision_end_token_id]
        + text(5)
    )
    pixels = torch.randn(grid[0] * grid[1] * grid[2], cfg.vision.patch_dim, generator=g)
    with torch.inference_mode():
        media = model.encode_media(pixels, [grid])  # the whole vision encoder, on every rank
    rows = torch.tensor([i for i, t in enumerate(img_ids) if t == cfg.image_token_id], dtype=torch.long)
    seqs = [img_ids, text(9)]
    pos = []
    for ids in seqs:
        p, delta = mrope_positions(
            ids,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            image_grid_thw=[grid] if cfg.image_token_id in ids else None,
            spatial_merge_size=cfg.vision.spatial_merge_size,
        )
        pos.append((p, delta))
    # The image prompt comes first, so its placeholder rows keep their packed index as sequences grow.
    mm = MultimodalEmbeddings(token_index=rows, embeds=media.embeds, deepstack=media.deepstack)
    return seqs, pos, mm


def _run(model: Qwen3VLModel) -> dict:
    """Prompt logits on every row, then greedy steps (full recompute through the dense backend)."""
    seqs, pos, mm = _prompts(model)
    seqs = [list(s) for s in seqs]
    prompt_lens = [len(s) for s in seqs]
    out: dict = {"tokens": [[] for _ in seqs], "step_logits": [], "attn_shapes": set()}
    with torch.inference_mode():
        for step in range(GREEDY_STEPS + 1):
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
            positions = torch.cat(
                [
                    torch.cat([p, decode_positions(n, d, len(s) - n)], dim=1)
                    for (p, d), n, s in zip(pos, prompt_lens, seqs, strict=True)
                ],
                dim=1,
            )
            backend = RecordingDense([len(s) for s in seqs])
            logits = model(ids, positions, backend, multimodal=mm)
            out["attn_shapes"] |= backend.shapes
            if step == 0:
                out["prompt_logits"] = logits.clone()
            cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
            last = logits.index_select(0, last_token_indices(cu))
            out["step_logits"].append(last.clone())
            if step == GREEDY_STEPS:
                break
            nxt = last.argmax(-1).tolist()
            for s, toks, t in zip(seqs, out["tokens"], nxt, strict=True):
                s.append(t)
                toks.append(t)
    return out


def _worker(rank: int, init_method: str, ckpts: dict[str, str]) -> dict:
    group = init_tp_group(rank, WORLD, init_method, backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    result: dict = {"min_int": [group.min_int(vals[rank]) for vals in MIN_INT_INPUTS]}
    for name, path in ckpts.items():
        model = load_model(path, dtype=torch.float32)
        if rank == 0:
            result[f"{name}/ref"] = _run(model)
        shard = shard_text_decoder(model, group)
        result[f"{name}/shard"] = shard
        result[f"{name}/tp"] = _run(model)
    return result


@pytest.fixture(scope="module")
def tp_results():
    ckpts = {"tiny": str(ensure_tiny_checkpoint()), "tiny-tied": str(ensure_checkpoint("tiny-tied"))}
    return run_ranks(_worker, WORLD, ckpts, timeout_s=JOIN_TIMEOUT_S)


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_tp2_logits_match_tp1(tp_results, name):
    r0, r1 = tp_results
    ref, tp = r0[f"{name}/ref"], r0[f"{name}/tp"]
    assert_tp_close(tp["prompt_logits"], ref["prompt_logits"], "prompt (every row)")
    for step, (a, b) in enumerate(zip(tp["step_logits"], ref["step_logits"], strict=True)):
        assert_tp_close(a, b, f"greedy step {step}")
    assert tp["tokens"] == ref["tokens"]
    assert all(len(t) == GREEDY_STEPS for t in tp["tokens"])
    # Every rank holds the same full logits, so each may sample on its own and stay in step.
    assert torch.equal(r1[f"{name}/tp"]["prompt_logits"], tp["prompt_logits"])
    assert r1[f"{name}/tp"]["tokens"] == tp["tokens"]
    print(f"{name}: max |TP2 - TP1| = {(tp['prompt_logits'] - ref['prompt_logits']).abs().max().item():.3g}")


@pytest.mark.parametrize("name", ["tiny", "tiny-tied"])
def test_backend_sees_only_local_heads(tp_results, name):
    cfg = Qwen3VLConfig.from_pretrained(ensure_tiny_checkpoint()).text
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    assert tp_results[0][f"{name}/ref"]["attn_shapes"] == {(hq, hkv, hkv)}
    for rank, res in enumerate(tp_results):
        assert res[f"{name}/tp"]["attn_shapes"] == {(hq // WORLD, hkv // WORLD, hkv // WORLD)}
        shard = res[f"{name}/shard"]
        assert shard.kv_heads == (rank * hkv // WORLD, (rank + 1) * hkv // WORLD)
        assert shard.q_heads == (rank * hq // WORLD, (rank + 1) * hq // WORLD)


def test_min_int_agrees_on_minimum(tp_results):
    expected = [min(vals) for vals in MIN_INT_INPUTS]
    for res in tp_results:
        assert res["min_int"] == expected


# ------------------------------------------------------------------------------ no processes needed
@pytest.fixture(scope="module")
def tiny_config() -> Qwen3VLConfig:
    return Qwen3VLConfig.from_pretrained(ensure_tiny_checkpoint())


def _meta_model(cfg: Qwen3VLConfig) -> Qwen3VLModel:
    with torch.device("meta"):
        return Qwen3VLModel(cfg)


@pytest.mark.parametrize(
    ("kv_heads", "world", "names"),
    [
        (2, 3, ["num_attention_heads 4", "num_key_value_heads 2"]),  # 4 Q heads over 3 ranks
        (1, 2, ["num_key_value_heads 1"]),  # 1 KV head over 2 ranks: no KV head replication
        (2, 4, ["num_key_value_heads 2"]),
    ],
)
def test_indivisible_heads_raise_before_touching_the_model(tiny_config, kv_heads, world, names):
    cfg = dataclasses.replace(
        tiny_config, text=dataclasses.replace(tiny_config.text, num_key_value_heads=kv_heads)
    )
    model = _meta_model(cfg)
    qkv_before = model.language_model.layers[0].self_attn.qkv
    with pytest.raises(TensorParallelError) as err:
        shard_text_decoder(model, TPGroup(rank=0, world_size=world))
    for n in names:
        assert n in str(err.value)
    assert f"tensor parallel size {world}" in str(err.value)
    assert model.language_model.layers[0].self_attn.qkv is qkv_before


def test_plan_pads_an_indivisible_vocab(tiny_config):
    cfg = dataclasses.replace(tiny_config.text, vocab_size=1001)
    plans = [plan_text_shard(cfg, r, 2) for r in range(2)]
    assert [p.vocab for p in plans] == [(0, 501), (501, 1001)]
    assert all(p.vocab_shard_size == 501 for p in plans)


def test_tp_group_rejects_bad_rank_and_single_is_identity():
    with pytest.raises(TensorParallelError):
        TPGroup(rank=2, world_size=2)
    with pytest.raises(TensorParallelError):
        TPGroup(rank=0, world_size=0)
    one = TPGroup.single()
    t = torch.arange(6.0).reshape(2, 3)
    assert one.all_reduce_sum(t) is t and one.all_gather_last_dim(t) is t
    assert one.min_int(5) == 5
    with pytest.raises(TypeError):
        one.min_int(2.5)  # type: ignore[arg-type]
