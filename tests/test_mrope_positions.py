"""M-RoPE position ids vs HF transformers 5.17 `Qwen3VLModel.get_rope_index` (called with a minimal
stand-in `self`: only config.vision_config.spatial_merge_size and get_vision_position_ids are used; no
model, no weights), over random layouts of text, images and videos."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from prism.media.placeholders import SpecialTokens, VideoPlaceholder, expand_placeholders
from prism.model.mrope import (
    MRopeLayoutError,
    batched_decode_positions,
    decode_positions,
    mrope_positions,
    mrope_positions_from_spans,
    mrope_positions_from_token_types,
    split_video_grids,
)

IMG, VID, VS, VE = 151655, 151656, 151652, 151653  # test-local ids; the code under test receives them


def _hf_stub(merge: int) -> types.SimpleNamespace:
    stub = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))
    )
    stub.get_vision_position_ids = functools.partial(Qwen3VLModel.get_vision_position_ids, stub)
    return stub


def _hf_rope_index(ids, image_grids, video_grids, merge):
    ids_t = torch.as_tensor(ids, dtype=torch.int64)[None]
    types_t = torch.zeros_like(ids_t)
    types_t[ids_t == IMG] = 1
    types_t[ids_t == VID] = 2
    pos, delta = Qwen3VLModel.get_rope_index(
        _hf_stub(merge),
        ids_t,
        types_t,
        image_grid_thw=torch.tensor(image_grids).reshape(-1, 3) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids).reshape(-1, 3) if video_grids else None,
    )
    return pos[:, 0], int(delta.reshape(-1)[0])


segment = st.one_of(
    st.tuples(st.just("text"), st.integers(1, 5)),
    st.tuples(st.just("image"), st.tuples(st.sampled_from([1, 1, 2]), st.integers(1, 5), st.integers(1, 5))),
    st.tuples(
        st.just("video"),
        st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    ),
)


def _build(layout, merge, rng):
    """Token ids as Qwen3-VL lays them out, plus the grids and the pad runs (start, grid) we expect."""
    ids: list[int] = []
    image_grids, video_grids, spans = [], [], []
    for kind, value in layout:
        if kind == "text":
            ids += rng.integers(0, 1000, value).tolist()
        elif kind == "image":
            t, h, w = value[0], value[1] * merge, value[2] * merge
            image_grids.append([t, h, w])
            ids.append(VS)
            spans.append((len(ids), [t, h, w]))
            ids += [IMG] * (t * h * w // merge**2)
            ids.append(VE)
        else:
            t, h, w, ts_len = value[0], value[1] * merge, value[2] * merge, value[3]
            video_grids.append([t, h, w])
            for _ in range(t):
                ids += rng.integers(0, 1000, ts_len).tolist()  # the "<x.y seconds>" text
                ids.append(VS)
                spans.append((len(ids), [1, h, w]))
                ids += [VID] * (h * w // merge**2)
                ids.append(VE)
    return ids, image_grids, video_grids, spans


@settings(max_examples=150)
@given(
    layout=st.lists(segment, min_size=1, max_size=8),
    merge=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
    n_new=st.integers(1, 5),
)
def test_positions_equal_hf_get_rope_index(layout, merge, seed, n_new):
    rng = np.random.default_rng(seed)
    ids, image_grids, video_grids, spans = _build(layout, merge, rng)
    ref_pos, ref_delta = _hf_rope_index(ids, image_grids, video_grids, merge)

    pos, delta = mrope_positions(
        ids,
        image_token_id=IMG,
        video_token_id=VID,
        image_grid_thw=image_grids or None,
        video_grid_thw=video_grids or None,
        spatial_merge_size=merge,
    )
    assert pos.dtype == torch.int64 and pos.shape == (3, len(ids))
    assert torch.equal(pos, ref_pos) and delta == ref_delta

    starts = [s for s, _ in spans]
    grids = [g for _, g in spans]
    pos2, delta2 = mrope_positions_from_spans(len(ids), starts, grids, spatial_merge_size=merge)
    assert torch.equal(pos2, ref_pos) and delta2 == ref_delta

    # Tokens appended after the prompt: HF over the longer sequence == our continuation positions
    # (for real layouts: images have t == 1 and videos are split per temporal patch).
    if all(g[0] == 1 for g in image_grids):
        more = ids + rng.integers(0, 1000, n_new).tolist()
        ext_pos, _ = _hf_rope_index(more, image_grids, video_grids, merge)
        assert torch.equal(ext_pos[:, len(ids) :], decode_positions(len(ids), delta, n_new))


def test_decode_matches_hf_incremental_path():
    stub = _hf_stub(2)
    for past, delta, k in [(10, -3, 1), (300, -150, 4), (5, 0, 2)]:
        stub.rope_deltas = torch.tensor([[delta]])
        cache = types.SimpleNamespace(get_seq_length=lambda past=past: past)
        ref = Qwen3VLModel.compute_3d_position_ids(
            stub, input_ids=None, inputs_embeds=torch.zeros(1, k, 4), past_key_values=cache
        )
        assert torch.equal(decode_positions(past, delta, k), ref[:, 0])
    so_far = torch.tensor([7, 100, 3])
    deltas = torch.tensor([-2, -50, 0])
    batched = batched_decode_positions(so_far, deltas)
    for b in range(3):
        assert torch.equal(batched[:, b : b + 1], decode_positions(int(so_far[b]), int(deltas[b])))


def test_expanded_prompt_spans_feed_mrope():
    special = SpecialTokens(IMG, VID, VS, VE)
    prompt = [1, VS, IMG, VE, 2, 3, VS, VID, VE, 4, VS, IMG, VE]
    out = expand_placeholders(
        prompt,
        special=special,
        merge_size=2,
        image_grids=[(1, 4, 6), (1, 2, 2)],
        videos=[VideoPlaceholder((3, 4, 4), (0.5, 1.5, 2.5))],
        encode_text=lambda s: [ord(c) for c in s],
    )
    a = mrope_positions_from_spans(
        len(out.input_ids), out.span_starts(), out.span_grids(), spatial_merge_size=2
    )
    b = mrope_positions_from_token_types(
        out.mm_token_type_ids,
        image_grid_thw=out.image_grid_thw,
        video_grid_thw=out.video_grid_thw,
        spatial_merge_size=2,
    )
    ref = _hf_rope_index(out.input_ids.tolist(), out.image_grid_thw.tolist(), out.video_grid_thw.tolist(), 2)
    assert torch.equal(a[0], ref[0]) and a[1] == ref[1]
    assert torch.equal(b[0], ref[0]) and b[1] == ref[1]


def test_eight_image_prompt():
    # The bench shape: 8 images of 448x448 (28x28 patches -> 196 tokens each) and a question.
    rng = np.random.default_rng(0)
    layout = [("text", 12)] + [("image", (1, 14, 14)), ("text", 1)] * 8 + [("text", 30)]
    ids, image_grids, _, _ = _build(layout, 2, rng)
    pos, delta = mrope_positions(
        ids, image_token_id=IMG, video_token_id=VID, image_grid_thw=image_grids, spatial_merge_size=2
    )
    ref_pos, ref_delta = _hf_rope_index(ids, image_grids, [], 2)
    assert torch.equal(pos, ref_pos) and delta == ref_delta
    assert delta == -8 * (196 - 14)


def test_text_only_and_split_video_grids():
    pos, delta = mrope_positions(list(range(7)), image_token_id=IMG, video_token_id=VID, spatial_merge_size=2)
    assert torch.equal(pos, torch.arange(7).expand(3, -1)) and delta == 0
    assert split_video_grids([[2, 4, 6], [1, 2, 2]]).tolist() == [[1, 4, 6], [1, 4, 6], [1, 2, 2]]


def test_layout_errors():
    kw = dict(image_token_id=IMG, video_token_id=VID, spatial_merge_size=2)
    with pytest.raises(MRopeLayoutError):  # run of 5 pads, grid needs 6
        mrope_positions([1, *[IMG] * 5, 2], image_grid_thw=[[1, 4, 6]], **kw)
    with pytest.raises(MRopeLayoutError):  # an image run but no grid
        mrope_positions([1, IMG, 2], **kw)
    with pytest.raises(MRopeLayoutError):  # two adjacent images form one run
        mrope_positions([1, *[IMG] * 2, 2], image_grid_thw=[[1, 2, 2], [1, 2, 2]], **kw)
    with pytest.raises(MRopeLayoutError):  # video pads for 2 temporal patches in a single run
        mrope_positions([1, *[VID] * 2, 2], video_grid_thw=[[2, 2, 2]], **kw)
    with pytest.raises(MRopeLayoutError):
        mrope_positions([], **kw)
    with pytest.raises(MRopeLayoutError):
        mrope_positions([1, IMG], image_grid_thw=[[1, 3, 2]], **kw)  # not divisible by merge
    with pytest.raises(MRopeLayoutError):
        mrope_positions_from_token_types([0, 3, 0], spatial_merge_size=2)
    with pytest.raises(MRopeLayoutError):  # overlapping spans
        mrope_positions_from_spans(10, [1, 2], [[1, 4, 4], [1, 2, 2]], spatial_merge_size=2)
    with pytest.raises(MRopeLayoutError):  # span past the end
        mrope_positions_from_spans(3, [2], [[1, 4, 4]], spatial_merge_size=2)
    with pytest.raises(MRopeLayoutError):
        mrope_positions_from_spans(3, [0.5], [[1, 2, 2]], spatial_merge_size=2)
    with pytest.raises(MRopeLayoutError):
        decode_positions(-1, 0)
