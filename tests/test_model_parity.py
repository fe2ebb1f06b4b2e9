"""Prism's Qwen3-VL vs HF transformers on the tiny random checkpoint, fp32.

Inputs come from HF's own classes (PIL image processor, Qwen3-VL processor expansion, video
patchify, get_rope_index); both models get the same ids, pixels and positions. Logits must agree
to 1e-4 of their magnitude; greedy decoding must pick the same 32 tokens with matching per-step
logits; packing several prompts into one step must not change any of them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prism.model.attention import AttentionBackend, DenseCausalAttention
from prism.model.loading import load_model
from prism.model.qwen3_vl import last_token_indices
from prism.testing.checkpoints import build_checkpoint
from prism.testing.hf_reference import (
    extend_positions,
    hf_processor,
    image_inputs,
    random_images,
    video_inputs,
)

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4
THREE_SIZES = [(300, 200), (64, 500), (256, 256)]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = REL_TOL) -> None:
    assert ours.shape == ref.shape
    scale = ref.abs().max().item()
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3g} > {rel} * max|logits| {scale:.3g}"


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    # Tiny shapes gain nothing from intra-op threads, and on a shared 2-core machine OpenMP
    # spin-waiting made these tests 4x slower; restored for the modules that follow.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    # No eos in greedy comparisons: both sides must produce every requested token.
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype=torch.float32)


@pytest.fixture(scope="module")
def processor(ckpt):
    return hf_processor(ckpt)


@pytest.fixture(scope="module")
def prompts(processor, hf_model):
    frames = np.random.default_rng(7).integers(0, 256, (4, 128, 160, 3), dtype=np.uint8)
    return {
        "text": image_inputs(processor, hf_model, "Hello, what can you tell me about cats?", []),
        "image": image_inputs(
            processor, hf_model, "Describe the picture.", random_images([(300, 200)], seed=1)
        ),
        "three_images": image_inputs(
            processor, hf_model, "Compare them.", random_images(THREE_SIZES, seed=2)
        ),
        "video": video_inputs(processor, hf_model, "What happens in the video?", frames),
    }


@pytest.fixture(scope="module")
def hf_logits(hf_model, prompts):
    with torch.no_grad():
        return {k: hf_model(**p.hf_kwargs()).logits[0] for k, p in prompts.items()}


def run_ours(model, inp, **kw) -> torch.Tensor:
    n = inp.input_ids.shape[1]
    with torch.no_grad():
        return model(inp.input_ids[0], inp.positions, DenseCausalAttention([n]), **inp.media_kwargs(), **kw)


@pytest.mark.parametrize("case", ["text", "image", "three_images", "video"])
def test_logits_match_hf(model, prompts, hf_logits, case):
    inp = prompts[case]
    if case == "three_images":
        assert [tuple(g) for g in inp.image_grid_thw.tolist()] == [(1, 20, 14), (1, 6, 46), (1, 16, 16)]
    if case == "video":
        assert inp.video_grid_thw.tolist() == [[2, 8, 10]]
    assert_logits_close(run_ours(model, inp), hf_logits[case])


def test_placeholders_by_type_ids_equal_by_token_ids(model, prompts):
    inp = prompts["three_images"]
    by_ids = run_ours(model, inp)
    by_types = run_ours(model, inp, mm_token_type_ids=inp.mm_token_type_ids[0])
    assert torch.equal(by_ids, by_types)


def test_precomputed_multimodal_equals_pixel_path(model, prompts):
    inp = prompts["video"]
    n = inp.input_ids.shape[1]
    with torch.no_grad():
        mm = model.multimodal_embeddings(inp.input_ids[0], **inp.media_kwargs())
        assert mm is not None and mm.deepstack.shape[0] == len(model.config.vision.deepstack_visual_indexes)
        pre = model(inp.input_ids[0], inp.positions, DenseCausalAttention([n]), multimodal=mm)
    assert torch.equal(pre, run_ours(model, inp))


def test_packed_batch_equals_each_prompt(model, prompts, hf_logits):
    """Four prompts (text, 1 image, 3 images, video) in one packed step == each run by HF alone."""
    order = ["text", "image", "three_images", "video"]
    ids = torch.cat([prompts[k].input_ids[0] for k in order])
    pos = torch.cat([prompts[k].positions for k in order], dim=1)
    lens = [prompts[k].input_ids.shape[1] for k in order]
    cu = torch.tensor([0, *np.cumsum(lens).tolist()])
    img = [prompts[k] for k in order if prompts[k].pixel_values is not None]
    with torch.no_grad():
        logits = model(
            ids,
            pos,
            DenseCausalAttention.from_cu_seqlens(cu),
            pixel_values=torch.cat([p.pixel_values for p in img]),
            image_grid_thw=torch.cat([p.image_grid_thw for p in img]),
            pixel_values_videos=prompts["video"].pixel_values_videos,
            video_grid_thw=prompts["video"].video_grid_thw,
        )
        last = model(
            ids,
            pos,
            DenseCausalAttention.from_cu_seqlens(cu),
            multimodal=model.multimodal_embeddings(
                ids,
                pixel_values=torch.cat([p.pixel_values for p in img]),
                image_grid_thw=torch.cat([p.image_grid_thw for p in img]),
                pixel_values_videos=prompts["video"].pixel_values_videos,
                video_grid_thw=prompts["video"].video_grid_thw,
            ),
            logits_indices=last_token_indices(cu),
        )
    for i, k in enumerate(order):
        assert_logits_close(logits[cu[i] : cu[i + 1]], hf_logits[k])
        assert_logits_close(last[i], hf_logits[k][-1])


@pytest.mark.parametrize("case", ["text", "image", "three_images", "video"])
def test_greedy_32_tokens_match_hf_generate(model, hf_model, prompts, case):
    from transformers import GenerationConfig

    inp = prompts[case]
    steps = 32
    gc = GenerationConfig(
        max_new_tokens=steps, min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf_model.generate(
            **inp.hf_kwargs(), generation_config=gc, output_logits=True, return_dict_in_generate=True
        )
    ref_tokens = out.sequences[0, inp.input_ids.shape[1] :].tolist()
    assert len(ref_tokens) == steps

    ids, types = inp.input_ids[0], inp.mm_token_type_ids[0]
    with torch.no_grad():
        mm = (
            model.multimodal_embeddings(ids, mm_token_type_ids=types, **inp.media_kwargs())
            if inp.media_kwargs()
            else None
        )
        gen: list[int] = []
        for step in range(steps):
            cur = torch.cat([ids, torch.tensor(gen, dtype=ids.dtype)])
            n = cur.shape[0]
            logits = model(
                cur,
                extend_positions(inp.positions, len(gen)),
                DenseCausalAttention([n]),
                multimodal=mm,
                logits_indices=torch.tensor([n - 1]),
            )[0]
            assert_logits_close(logits, out.logits[step][0])
            gen.append(int(logits.argmax()))
    assert gen == ref_tokens


def test_tied_embeddings_checkpoint_matches_hf(tmp_path):
    from transformers import Qwen3VLForConditionalGeneration

    ckpt = build_checkpoint("tiny-tied", tmp_path / "tied")
    hf = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = load_model(ckpt, dtype=torch.float32)
    assert ours.lm_head is None
    inp = image_inputs(hf_processor(ckpt), hf, "Describe.", random_images([(96, 128)], seed=3))
    with torch.no_grad():
        ref = hf(**inp.hf_kwargs()).logits[0]
    assert_logits_close(run_ours(ours, inp), ref)


def test_bf16_tracks_hf_bf16(ckpt, prompts):
    from transformers import Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    ours = load_model(ckpt, dtype=torch.bfloat16)
    inp = prompts["image"]
    with torch.no_grad():
        ref = hf(**inp.hf_kwargs()).logits[0].float()
    got = run_ours(ours, inp)
    assert got.dtype == torch.bfloat16
    # Different kernels round differently in bf16; the logits still agree to a few bf16 ulps.
    assert_logits_close(got.float(), ref, rel=3e-2)


def test_bad_inputs_raise(model, prompts):
    assert isinstance(DenseCausalAttention([1]), AttentionBackend)
    inp = prompts["image"]
    ids = inp.input_ids[0]
    n = ids.shape[0]
    backend = DenseCausalAttention([n])
    with pytest.raises(ValueError, match="do not match"):
        model(ids[:-20], inp.positions[:, :-20], DenseCausalAttention([n - 20]), **inp.media_kwargs())
    with pytest.raises(ValueError, match="no image pixels"):
        model.multimodal_embeddings(ids)
    with pytest.raises(ValueError, match="positions must be"):
        model(ids, inp.positions[:2], backend)
    with pytest.raises(ValueError, match="pixel_values must be"):
        model(
            ids, inp.positions, backend, pixel_values=inp.pixel_values[:-4], image_grid_thw=inp.image_grid_thw
        )
    with pytest.raises(ValueError, match="segments sum"):
        model(ids, inp.positions, DenseCausalAttention([n - 1]))
