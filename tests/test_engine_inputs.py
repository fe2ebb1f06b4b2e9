"""engine.inputs: chat messages / raw prompts with media -> PreparedPrompt, checked against HF transformers 5.17.

Token ids, modality ids, grids and pixels are compared with HF's `Qwen3VLProcessor.apply_chat_template` on the
tiny checkpoint; positions with HF's `Qwen3VLModel.get_rope_index` (called with a minimal stand-in `self`, no
weights). HF's video processor needs torchvision, which is not installed here: for videos the grid, frame
indices and timestamps come from prism.media's own video path and HF's processor does the text replacement
(`replace_video_token`) and tokenization, as in tests/test_placeholder_expansion.py.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import shutil
import types

import numpy as np
import pytest
import torch
from PIL import Image

from prism.engine.inputs import (
    ChatTemplateError,
    InputError,
    InputProcessor,
    PromptTooLongError,
    VideoInput,
)
from prism.engine.media_preparation import video_span_digest
from prism.kv.content import SeqContent
from prism.media.cache import PreprocessCache
from prism.media.errors import ImageTooLargeError, MediaDecodeError, MediaError, VideoError
from prism.media.image import DecodeLimits
from prism.media.video import preprocess_video
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import hf_processor, random_images

transformers = pytest.importorskip("transformers")

THREE_SIZES = [(300, 200), (64, 500), (256, 256)]


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ckpt():
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def proc(ckpt):
    return InputProcessor(ckpt, model_id="tiny")


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_processor(ckpt)


@pytest.fixture(scope="module")
def frames():
    return np.random.default_rng(7).integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)


def _copy_ckpt(ckpt, dst):
    """The checkpoint's small files (InputProcessor reads no weights)."""
    dst.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _hf_rope_index(hf_proc, ids, types_, image_grid=None, video_grid=None):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    merge = hf_proc.image_processor.merge_size
    stub = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))
    )
    stub.get_vision_position_ids = functools.partial(Qwen3VLModel.get_vision_position_ids, stub)
    pos, delta = Qwen3VLModel.get_rope_index(
        stub,
        torch.as_tensor(ids, dtype=torch.int64)[None],
        torch.as_tensor(types_, dtype=torch.int64)[None],
        image_grid_thw=None if image_grid is None else torch.as_tensor(np.asarray(image_grid)),
        video_grid_thw=None if video_grid is None else torch.as_tensor(np.asarray(video_grid)),
    )
    return pos[:, 0], int(delta.reshape(-1)[0])


def _assert_spans_line_up(proc, p):
    """Every pad run is exactly one MediaSpan, in prompt order, with its media's digest."""
    ids = np.asarray(p.token_ids)
    mm = p.mm_token_type_ids.numpy()
    content = p.kv_content()
    assert isinstance(content, SeqContent) and content.tokens == p.token_ids
    assert content.tokens is not p.token_ids  # decode appends to the content's list, not the prompt's
    covered = np.zeros(len(ids), dtype=bool)
    for span in content.media:
        run = slice(span.start, span.end)
        assert len(span.digest) == 32
        assert (mm[run] != 0).all() and len(set(ids[run].tolist())) == 1
        assert span.start == 0 or mm[span.start - 1] == 0  # maximal run: text on both sides
        assert span.end == len(ids) or mm[span.end] == 0
        covered[run] = True
    assert (covered == (mm != 0)).all()
    assert content.media == p.media_spans()
    assert [start for m in p.media for start, _ in m.spans] == sorted(s.start for s in content.media)
    assert p.num_media_tokens == int((mm != 0).sum())
    for m in p.media:
        pad = proc.special.image_pad if m.kind == "image" else proc.special.video_pad
        assert all((ids[start : start + n] == pad).all() for start, n in m.spans)
        assert [(s.start, s.length) for s in m.kv_spans] == list(m.spans)
        assert [s.digest for s in m.kv_spans] == list(m.span_digests)
        if m.kind == "image":
            assert m.span_digests == (m.digest,)
        t, h, w = m.grid_thw
        assert m.num_tokens == t * h * w // 4 and m.pixel_values.shape[0] == t * h * w


# ------------------------------------------------------------------------------------------ HF parity
def test_text_only_matches_hf(proc, hf):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, what can you tell me about cats?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Cats are small."}]},
        {"role": "user", "content": [{"type": "text", "text": "And dogs? 第一张图"}]},
    ]
    ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    p = proc.prepare_chat(messages)
    assert p.token_ids == list(ref["input_ids"][0])
    assert p.mm_token_type_ids.tolist() == list(ref["mm_token_type_ids"][0]) == [0] * len(p)
    n = len(p)
    assert torch.equal(p.positions, torch.arange(n).expand(3, n)) and p.rope_delta == 0
    assert p.media == () and p.kv_content().media == ()
    no_gen = proc.prepare_chat(messages, add_generation_prompt=False)
    ref2 = hf.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=False)
    assert no_gen.token_ids == list(ref2["input_ids"][0]) and len(no_gen) < n


@pytest.mark.parametrize("case", ["one_image", "three_images"])
def test_images_match_hf(proc, hf, case):
    if case == "one_image":
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": random_images([(300, 200)], seed=1)[0]},
                    {"type": "text", "text": "Describe the picture."},
                ],
            }
        ]
    else:
        a, b, c = random_images(THREE_SIZES, seed=2)
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A cat."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": b},
                    {"type": "text", "text": " and "},
                    {"type": "image", "image": c},
                    {"type": "text", "text": "Compare them."},
                ],
            },
        ]
    ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    p = proc.prepare_chat(messages)
    assert p.token_ids == list(ref["input_ids"][0])
    assert p.mm_token_type_ids.tolist() == list(ref["mm_token_type_ids"][0])
    assert p.image_grid_thw.tolist() == np.asarray(ref["image_grid_thw"]).tolist()
    if case == "three_images":
        assert [m.grid_thw for m in p.media] == [(1, 20, 14), (1, 6, 46), (1, 16, 16)]
    pixels = torch.cat([m.pixel_values for m in p.images])
    assert torch.equal(pixels, torch.as_tensor(np.asarray(ref["pixel_values"])))
    pos, delta = _hf_rope_index(hf, p.token_ids, p.mm_token_type_ids, image_grid=ref["image_grid_thw"])
    assert p.positions.dtype == torch.int64 and torch.equal(p.positions, pos)
    assert p.rope_delta == delta
    assert [m.kind for m in p.media] == ["image"] * len(p.images)
    assert [m.index for m in p.media] == list(range(len(p.media)))
    _assert_spans_line_up(proc, p)


def test_video_and_image_match_prism_media_plus_hf_expansion(proc, hf, frames):
    from transformers.video_utils import VideoMetadata

    image = random_images([(128, 160)], seed=3)[0]
    fps = 2.0
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": list(frames), "fps": fps},
                {"type": "image", "image": image},
                {"type": "text", "text": "What happens in the video?"},
            ],
        }
    ]
    p = proc.prepare_chat(messages)

    pre = preprocess_video(frames, fps, proc.video_config)
    assert pre.grid_thw[0] >= 2  # several temporal patches -> several spans
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(pre.frame_indices))
    grid = torch.tensor([pre.grid_thw])
    replacement = hf.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
    skeleton = [
        {
            "role": "user",
            "content": [
                {"type": "video"},
                {"type": "image"},
                {"type": "text", "text": messages[0]["content"][2]["text"]},
            ],
        }
    ]
    text = hf.apply_chat_template(skeleton, tokenize=False, add_generation_prompt=True)
    (expanded,), _ = hf.get_text_with_replacements([text], [], [replacement])
    ref = hf(text=[expanded], images=[image])
    assert p.token_ids == list(ref["input_ids"][0])
    assert p.mm_token_type_ids.tolist() == list(ref["mm_token_type_ids"][0])
    pos, delta = _hf_rope_index(
        hf, p.token_ids, p.mm_token_type_ids, image_grid=ref["image_grid_thw"], video_grid=grid
    )
    assert torch.equal(p.positions, pos) and p.rope_delta == delta

    video, img = p.media
    assert (video.kind, img.kind) == ("video", "image") and video.end < img.start
    assert video.grid_thw == pre.grid_thw and torch.equal(video.pixel_values, pre.pixel_values_videos)
    assert video.timestamps == pre.timestamps
    assert len(video.spans) == pre.grid_thw[0]
    span_digests = list(video.span_digests)
    assert span_digests == [video_span_digest(video.digest, k) for k in range(len(span_digests))]
    assert len(set(span_digests)) == len(span_digests) and video.digest not in span_digests
    for start, _ in video.spans[1:]:  # timestamp text between the runs
        assert "seconds>" in proc.decode(p.token_ids[start - 8 : start], skip_special_tokens=True)
    _assert_spans_line_up(proc, p)

    # Frames as one array, as PIL images, or as a list of arrays: the same video.
    as_pil = proc.prepare_chat(
        [
            {
                "role": "user",
                "content": [{"type": "video", "video": [Image.fromarray(f) for f in frames], "fps": fps}],
            }
        ]
    )
    as_array = proc.prepare_prompt(
        "<|vision_start|><|video_pad|><|vision_end|>", videos=[VideoInput(frames, fps)]
    )
    assert as_pil.media[0].digest == as_array.media[0].digest == video.digest
    # Another frame rate -> other timestamps -> another digest.
    slower = proc.prepare_prompt(
        "<|vision_start|><|video_pad|><|vision_end|>", videos=[{"video": frames, "fps": 1.0}]
    )
    assert slower.media[0].digest != video.digest


# ------------------------------------------------------------------------------------------ identity
def test_same_pixels_same_digest_in_any_form(proc):
    img = random_images([(90, 130)], seed=5)[0]
    arr = np.asarray(img)
    png = _png(img)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    forms = [png, bytearray(png), img, arr, img.convert("RGBA")]
    prompts = [
        proc.prepare_chat(
            [{"role": "user", "content": [{"type": "image", "image": f}, {"type": "text", "text": "?"}]}]
        )
        for f in forms
    ]
    prompts.append(
        proc.prepare_chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "?"},
                    ],
                }
            ]
        )
    )
    digests = {p.media[0].digest for p in prompts}
    assert len(digests) == 1
    assert all(p.token_ids == prompts[0].token_ids for p in prompts)
    assert all(torch.equal(p.positions, prompts[0].positions) for p in prompts)

    other = arr.copy()
    other[3, 4, 0] ^= 1  # one channel of one pixel
    changed = proc.prepare_chat(
        [{"role": "user", "content": [{"type": "image", "image": other}, {"type": "text", "text": "?"}]}]
    )
    assert changed.token_ids == prompts[0].token_ids  # same placeholders ...
    assert changed.media[0].digest not in digests  # ... other pixels: never the same key
    assert changed.kv_content().media[0].digest != prompts[0].kv_content().media[0].digest

    other_model = InputProcessor(proc.model_dir, model_id="another-model")
    assert (
        other_model.prepare_prompt("<|vision_start|><|image_pad|><|vision_end|>", [png]).media[0].digest
        not in digests
    )

    # The same image twice: one digest, two spans at different positions.
    twice = proc.prepare_prompt(
        "<|vision_start|><|image_pad|><|vision_end|>x<|vision_start|><|image_pad|><|vision_end|>", [png, arr]
    )
    s0, s1 = twice.kv_content().media
    assert s0.digest == s1.digest == prompts[0].media[0].digest and s0.end < s1.start
    _assert_spans_line_up(proc, twice)


def test_prepare_prompt_equals_prepare_chat(proc, hf, frames):
    a, b = random_images([(100, 80), (50, 200)], seed=9)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": a},
                {"type": "video", "video": frames, "fps": 2.0},
                {"type": "image", "image": b},
                {"type": "text", "text": "Q?"},
            ],
        }
    ]
    chat = proc.prepare_chat(messages)
    text, media = proc.render_chat(messages)
    raw = proc.prepare_prompt(text, images=[a, b], videos=[VideoInput(frames, 2.0)])
    assert raw.token_ids == chat.token_ids and raw.text == chat.text == text
    assert torch.equal(raw.positions, chat.positions) and raw.rope_delta == chat.rope_delta
    assert raw.kv_content().media == chat.kv_content().media
    assert [(m.kind, m.index) for m in chat.media] == [("image", 0), ("video", 0), ("image", 1)]
    assert text == hf.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "video"},
                    {"type": "image"},
                    {"type": "text", "text": "Q?"},
                ],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    _assert_spans_line_up(proc, chat)


# ------------------------------------------------------------------------------------------ cache
def test_preprocess_cache_hits_second_identical_media(ckpt, frames):
    cache = PreprocessCache(64 * 1024 * 1024)
    proc = InputProcessor(ckpt, model_id="tiny", cache=cache)
    img = random_images([(120, 90)], seed=11)[0]
    png = _png(img)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe."

    first = proc.prepare_prompt(prompt, [png])
    assert (cache.stats().hits, cache.stats().misses) == (0, 1)
    second = proc.prepare_prompt(prompt, [bytes(png)])
    assert (cache.stats().hits, cache.stats().misses) == (1, 1)
    assert second.media[0].pixels is first.media[0].pixels  # reused, not recomputed
    assert second.media[0].digest == first.media[0].digest

    # Decoded pixels: their own keys (a PIL image's storage, an array's bytes), the same content digest.
    pil_1 = proc.prepare_prompt(prompt, [img])
    pil_2 = proc.prepare_prompt(prompt, [img.copy()])
    arr_1 = proc.prepare_prompt(prompt, [np.asarray(img)])
    arr_2 = proc.prepare_prompt(prompt, [np.asarray(img).copy()])
    assert (cache.stats().hits, cache.stats().misses) == (3, 3)
    assert pil_2.media[0].pixels is pil_1.media[0].pixels and arr_2.media[0].pixels is arr_1.media[0].pixels
    assert pil_1.media[0].digest == arr_1.media[0].digest == first.media[0].digest

    vprompt = "<|vision_start|><|video_pad|><|vision_end|>"
    v1 = proc.prepare_prompt(vprompt, videos=[VideoInput(frames, 2.0)])
    v2 = proc.prepare_prompt(vprompt, videos=[VideoInput([f.copy() for f in frames], 2.0)])
    assert (cache.stats().hits, cache.stats().misses) == (4, 4)
    assert v2.media[0].pixels is v1.media[0].pixels

    # Same pixel bytes in another shape: another image, never a cache hit.
    flat = np.random.default_rng(12).integers(0, 256, 40 * 60 * 3, dtype=np.uint8)
    wide = proc.prepare_prompt(prompt, [flat.reshape(40, 60, 3)])
    tall = proc.prepare_prompt(prompt, [flat.reshape(60, 40, 3)])
    assert (cache.stats().hits, cache.stats().misses) == (4, 6)
    assert wide.media[0].digest != tall.media[0].digest
    assert wide.media[0].grid_thw != tall.media[0].grid_thw

    # Another model id sharing the cache: other namespace -> a miss and another digest.
    other = InputProcessor(ckpt, model_id="tiny-other", cache=cache)
    o = other.prepare_prompt(prompt, [png])
    assert (cache.stats().hits, cache.stats().misses) == (4, 7)
    assert o.media[0].digest != first.media[0].digest

    # cache_bytes: a private cache of that size.
    own = InputProcessor(ckpt, model_id="tiny", cache_bytes=8 * 1024 * 1024)
    assert own.cache is not None and own.cache is not cache
    own.prepare_prompt(prompt, [png])
    own.prepare_prompt(prompt, [png])
    assert (own.cache.stats().hits, own.cache.stats().misses) == (1, 1)
    assert InputProcessor(ckpt, cache_bytes=0).cache is None
    with pytest.raises(InputError, match="not both"):
        InputProcessor(ckpt, cache=cache, cache_bytes=10)


# ------------------------------------------------------------------------------------------ errors
def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_a_tokenizer_that_is_not_byte_level_is_refused_at_load(ckpt, tmp_path):
    """The detokenizer and the logprobs read tokens as their bytes (`engine.detokenize.ByteLevelVocab`)."""
    import json
    import shutil

    other = tmp_path / "ckpt"
    shutil.copytree(ckpt, other)
    spec = json.loads((other / "tokenizer.json").read_text(encoding="utf-8"))
    spec["decoder"] = {"type": "Metaspace", "replacement": "_", "prepend_scheme": "always", "split": True}
    (other / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(InputError, match="tokenizer.json: the tokenizer must be byte-level BPE .* decoder is Metaspace"):
        InputProcessor(other, model_id="tiny")


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "empty"),
        ("hello", "list of dicts"),
        (["hello"], "must be a dict"),
        ([{"content": "hi"}], "role"),
        ([{"role": "user", "content": 42}], "content must be"),
        (_user({"type": "audio", "audio": b"x"}), "unknown part type 'audio'"),
        (_user({"text": "no type"}), "unknown part type None"),
        (_user({"type": "text", "text": 3}), "string 'text'"),
        (_user({"type": "image"}), "no 'image' data"),
        (_user({"type": "image", "image": None}), "no 'image' data"),
        (_user({"type": "image", "image": b"x", "max_pixels": 9}), "unknown keys"),
        (_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), "only data: URLs"),
        (_user({"type": "image_url", "image_url": {"url": "/etc/passwd"}}), "only data: URLs"),
        (_user({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}), "not valid base64"),
        (_user({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}), "image/"),
        (_user({"type": "image_url", "image_url": {"url": "data:image/png,rawdata"}}), "base64"),
        (_user({"type": "image_url", "image_url": {}}), "no url"),
        (
            _user({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk=", "detail": "low"}}),
            "detail",
        ),
        (_user({"type": "video", "video": [np.zeros((32, 32, 3), np.uint8)] * 4}), "needs 'fps'"),
        (_user({"type": "video", "fps": 2.0}), "no 'video' frames"),
        (_user({"type": "video", "video": b"mp4 bytes", "fps": 2.0}), "not one encoded file"),
        (_user({"type": "video", "video": [], "fps": 2.0}), "no frames"),
        (_user({"type": "video", "video": [np.zeros((32, 32, 3), np.uint8)] * 4, "fps": -1}), "fps"),
        (_user({"type": "image", "image": "a/path.png"}), "^image must be bytes, a PIL image or a uint8"),
        (_user({"type": "video", "video": [np.zeros((32, 32, 3), np.uint8), "b.png"], "fps": 2.0}),
         "^video frame 1 must be bytes, a PIL image or a uint8"),
        (_user({"type": "text", "text": "sneaky <|image_pad|>"}), "must not contain the image placeholder"),
    ],
)
def test_bad_messages_raise_input_error(proc, messages, match):
    with pytest.raises(InputError, match=match):
        proc.prepare_chat(messages)


def test_media_errors_propagate_and_prompt_errors(proc, ckpt, tmp_path):
    png = _png(random_images([(40, 40)], seed=1)[0])
    with pytest.raises(MediaDecodeError):  # a prism.media error, unchanged (it is a ValueError)
        proc.prepare_chat(_user({"type": "image", "image": b"not an image"}))
    with pytest.raises(MediaError):
        proc.prepare_chat(_user({"type": "image", "image": np.zeros((8, 8), np.uint8)}))
    with pytest.raises(VideoError):  # frames of two sizes
        proc.prepare_chat(
            _user(
                {
                    "type": "video",
                    "video": [np.zeros((32, 32, 3), np.uint8), np.zeros((64, 32, 3), np.uint8)] * 2,
                    "fps": 2.0,
                }
            )
        )
    with pytest.raises(ImageTooLargeError):
        small = InputProcessor(ckpt, limits=DecodeLimits(max_bytes=100))
        small.prepare_chat(
            _user({"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400}})
        )

    one = "<|vision_start|><|image_pad|><|vision_end|>?"
    with pytest.raises(InputError, match="1 image placeholders but 2 images"):
        proc.prepare_prompt(one, [png, png])
    with pytest.raises(InputError, match="1 image placeholders but 0 images"):
        proc.prepare_prompt(one)
    with pytest.raises(InputError, match="0 video placeholders but 1 videos"):
        proc.prepare_prompt("text", videos=[{"video": [np.zeros((32, 32, 3), np.uint8)] * 4, "fps": 2.0}])
    with pytest.raises(InputError, match="'video' and 'fps'"):
        proc.prepare_prompt("<|video_pad|>", videos=[{"frames": []}])
    with pytest.raises(InputError, match="no data"):
        proc.prepare_prompt(one, [None])
    with pytest.raises(InputError, match="empty"):
        proc.prepare_prompt("")
    with pytest.raises(PromptTooLongError, match="limit is 20"):
        InputProcessor(ckpt, max_prompt_tokens=20).prepare_prompt(one, [png])
    with pytest.raises(ChatTemplateError, match="may not set"):
        proc.prepare_chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []})
    with pytest.raises(InputError, match="does not exist"):
        InputProcessor(tmp_path / "nowhere")


def test_template_sources_and_jinja_features(proc, ckpt, tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    expected = proc.render_chat(messages)[0]

    # Template only in tokenizer_config.json.
    d = _copy_ckpt(ckpt, tmp_path / "from_config")
    source = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = source
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert InputProcessor(d).render_chat(messages)[0] == expected

    # No template at all.
    cfg.pop("chat_template")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    bare = InputProcessor(d)
    assert bare.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.prepare_chat(messages)
    assert bare.prepare_prompt("plain text").token_ids == proc.encode("plain text")

    # HF's template environment: raise_exception, tojson without HTML escaping, {% generation %},
    # named special tokens, trim/lstrip blocks, loop controls, extra template kwargs.
    custom = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{% generation %}[{{ m.role }}|{{ m.content | tojson }}]{% endgeneration %}\n"
        "{% endfor %}{{ eos_token }}{% if flag %}!{% endif %}"
    )
    d2 = _copy_ckpt(ckpt, tmp_path / "custom")
    (d2 / "chat_template.jinja").write_text(custom)
    p2 = InputProcessor(d2)
    text, media = p2.render_chat(
        [
            {"role": "user", "content": "<a & b>"},
            {"role": "user", "content": "x"},
            {"role": "user", "content": "y"},
        ],
        chat_template_kwargs={"flag": True},
    )
    assert text == '[user|"<a & b>"][user|"x"]<|im_end|>!' and media == []
    with pytest.raises(ChatTemplateError, match="no tools here"):
        p2.prepare_chat([{"role": "tool", "content": "r"}])


def test_tokenizer_eos_and_decode(proc, ckpt):
    tok = proc.tokenizer
    assert proc.eos_token_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert list(proc.eos_token_ids) == gen["eos_token_id"]
    ids = proc.encode("The cat is sitting on the red mat.")
    assert proc.decode(ids) == "The cat is sitting on the red mat."
    p = proc.prepare_chat([{"role": "user", "content": "Yes or no?"}])
    assert proc.decode(p.token_ids, skip_special_tokens=False) == p.text
    assert "<|im_start|>" not in proc.decode(p.token_ids)


def test_a_media_memo_prepares_each_image_object_once(proc, monkeypatch):
    """A decision's questions share the material's image objects: with one memo, each is hashed and looked
    up once, and the prompts equal those prepared without the memo."""
    images = random_images([(64, 48), (32, 32)], seed=11)
    material = [{"role": "user", "content": [{"type": "image", "image": im} for im in images]}]
    questions = ["Which is larger?", "Are they the same?", "Describe them."]
    calls = []
    original = proc.media._image
    monkeypatch.setattr(proc.media, "_image", lambda data: calls.append(id(data)) or original(data))
    memo: dict = {}
    with_memo = [proc.prepare_chat([*material, {"role": "user", "content": q}], media_memo=memo) for q in questions]
    assert sorted(calls) == sorted(id(im) for im in images)
    calls.clear()
    without = [proc.prepare_chat([*material, {"role": "user", "content": q}]) for q in questions]
    assert len(calls) == len(images) * len(questions)
    for a, b in zip(with_memo, without, strict=True):
        assert a.token_ids == b.token_ids and [m.digest for m in a.media] == [m.digest for m in b.media]


def test_a_media_memo_decodes_a_videos_sampled_frames_once(proc, monkeypatch):
    """The server hands a video over as its frames' bytes: a decision's questions on that material decode the frames
    it samples once for all of them (not once per question), and get the prompts prepared without the memo. The same
    frames object at another rate is another video, not the memo's."""
    from prism.media import image as media_image

    frames = [_png(im) for im in random_images([(32, 24)] * 12, seed=13)]  # 30 fps: 4 of the 12 sampled
    material = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 30.0}]}]
    questions = ["What happens?", "Is it day?", "Who moves?"]
    decoded, decode = [], media_image.decode_image
    monkeypatch.setattr(media_image, "decode_image", lambda data, limits: decoded.append(data) or decode(data, limits))
    memo: dict = {}
    with_memo = [proc.prepare_chat([*material, {"role": "user", "content": q}], media_memo=memo) for q in questions]
    assert sorted(map(id, decoded)) == sorted(id(frames[i]) for i in (0, 4, 7, 11))
    decoded.clear()
    without = [proc.prepare_chat([*material, {"role": "user", "content": q}]) for q in questions]
    assert len(decoded) == 4 * len(questions)
    for a, b in zip(with_memo, without, strict=True):
        assert a.token_ids == b.token_ids and [m.digest for m in a.media] == [m.digest for m in b.media]
        assert torch.equal(a.media[0].pixels, b.media[0].pixels)
    slower = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 2.0}]}]  # every frame sampled
    decoded.clear()
    prompt = proc.prepare_chat([*slower, {"role": "user", "content": questions[0]}], media_memo=memo)
    assert len(decoded) == 12 and prompt.media[0].grid_thw[0] == 6 and with_memo[0].media[0].grid_thw[0] == 2


def test_an_image_sent_with_a_uuid_can_then_be_named_by_it_alone(ckpt):
    """vLLM's convention: a part's `uuid` names its image; later prompts may send the uuid without the image
    (no decoding, no hashing) and get the same prepared media. An unknown uuid, a uuid re-pointed at another
    image, a malformed uuid and an image part with neither are clear InputErrors."""
    proc = InputProcessor(ckpt, model_id="tiny-uuid", cache_bytes=2**26)
    a, b = random_images([(64, 48), (32, 32)], seed=12)

    def chat(part):
        return [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]

    with pytest.raises(InputError, match="names no image"):
        proc.prepare_chat(chat({"type": "image", "image": None, "uuid": "pic-a"}))
    sent = proc.prepare_chat(chat({"type": "image", "image": a, "uuid": "pic-a"}))
    calls = []
    original = proc.media._image
    proc.media._image = lambda data: calls.append(data) or original(data)
    named = proc.prepare_chat(chat({"type": "image_url", "image_url": None, "uuid": "pic-a"}))
    assert not calls, "an image named by its uuid was prepared again"
    assert named.token_ids == sent.token_ids and named.media[0].digest == sent.media[0].digest
    assert torch.equal(named.media[0].pixels.patches, sent.media[0].pixels.patches)
    with pytest.raises(InputError, match="already names a different image"):
        proc.prepare_chat(chat({"type": "image", "image": b, "uuid": "pic-a"}))
    assert proc.prepare_chat(chat({"type": "image", "image": a, "uuid": "pic-a"})).media[0].digest == sent.media[0].digest
    for bad in ("", 7, "x" * 257):
        with pytest.raises(InputError, match="uuid must be"):
            proc.prepare_chat(chat({"type": "image", "image": a, "uuid": bad}))
    with pytest.raises(InputError, match="nor a 'uuid'"):
        proc.prepare_chat(chat({"type": "image", "image": None}))
    no_cache = InputProcessor(ckpt, model_id="tiny-uuid")
    with pytest.raises(InputError, match="preprocessing cache"):
        no_cache.prepare_chat(chat({"type": "image", "image": a, "uuid": "pic-a"}))


def test_image_names_are_bounded_and_forget_the_least_recently_used():
    from prism.engine.image_names import ImageNameConflict, ImageNames
    from prism.media.cache import CacheKey

    names = ImageNames(max_names=2)
    key = CacheKey(b"k" * 32, "ns")
    names.bind("a", key, b"1")
    names.bind("b", key, b"2")
    assert names.resolve("a") == (key, b"1")  # "a" is now the most recently used
    names.bind("c", key, b"3")  # forgets "b"
    assert names.resolve("b") is None and len(names) == 2
    with pytest.raises(ImageNameConflict):
        names.bind("a", key, b"2")
    names.bind("b", key, b"9")  # a forgotten name may be bound anew
    assert names.resolve("b") == (key, b"9")
    with pytest.raises(ValueError):
        ImageNames(max_names=0)


def test_a_uuid_may_name_an_image_a_later_part_of_the_same_prompt_sends(ckpt):
    proc = InputProcessor(ckpt, model_id="tiny-uuid-order", cache_bytes=2**26)
    (a,) = random_images([(64, 48)], seed=13)
    prompt = proc.prepare_chat([{"role": "user", "content": [
        {"type": "image", "image": None, "uuid": "later"}, {"type": "image", "image": a, "uuid": "later"},
        {"type": "text", "text": "Twice?"}]}])
    assert prompt.media[0].digest == prompt.media[1].digest


def test_a_name_follows_its_image_sent_again_as_other_bytes(ckpt):
    """Sent as PNG bytes, evicted, sent again as the same pixels in another form (another cache key): the name
    follows the key that holds the pixels now instead of pointing at the evicted one for good."""
    from prism.engine.image_names import ImageNames
    from prism.media.cache import CacheKey

    names = ImageNames()
    old, new = CacheKey(b"o" * 32, "ns"), CacheKey(b"n" * 32, "ns")
    names.bind("x", old, b"same")
    names.bind("x", new, b"same")
    assert names.resolve("x") == (new, b"same")


@pytest.mark.parametrize("slow", [0, -1], ids=["first image slow", "last image slow"])
def test_images_are_handed_on_in_prompt_order_while_later_ones_are_prepared(proc, monkeypatch, slow):
    """`on_image` (the engine encodes each image as it is handed on): in the prompt's order whatever order the
    media threads finish in (the first image slowest), and the first before the last is prepared (the last slowest)."""
    import time

    imgs = random_images([(40, 40)] * 4, seed=31 + slow)
    events = []
    prepare = proc.media._image

    def slowed(data):
        if data is imgs[slow]:
            time.sleep(0.3)
        out = prepare(data)
        events.append(("prepared", id(data)))
        return out

    monkeypatch.setattr(proc.media, "_image", slowed)
    handed = []

    def on_image(prepared):
        handed.append(prepared.digest)
        events.append(("handed", prepared.digest))

    prompt = proc.prepare_chat([{"role": "user", "content": [*({"type": "image", "image": im} for im in imgs),
                                                            {"type": "text", "text": "?"}]}], on_image=on_image)
    assert handed == [m.digest for m in prompt.media]
    if slow == -1:
        assert events.index(("handed", handed[0])) < events.index(("prepared", id(imgs[-1])))


def test_new_images_go_to_the_media_threads_as_a_few_tasks_in_prompt_order(proc, monkeypatch):
    """Seven new images: at most `_MEDIA_TASKS` tasks of consecutive images (a worker wakes ~0.2-0.4 ms after its
    task is queued on the H200's host), and each image's result is its own, in the prompt's order."""
    from prism.engine import media_preparation

    monkeypatch.setattr(media_preparation, "_MEDIA_TASKS", 3)
    imgs = random_images([(40, 40 + 8 * k) for k in range(7)], seed=41)
    alone = [proc.prepare_chat([{"role": "user", "content": [{"type": "image", "image": im}]}]).media[0].digest
             for im in imgs]
    submitted = []
    submit = proc.media._media_threads.submit
    monkeypatch.setattr(proc.media._media_threads, "submit", lambda fn, *a: submitted.append(a) or submit(fn, *a))
    fresh = random_images([(40, 40 + 8 * k) for k in range(7)], seed=41)  # equal pixels, new objects
    prompt = proc.prepare_chat([{"role": "user", "content": [*({"type": "image", "image": im} for im in fresh),
                                                            {"type": "text", "text": "?"}]}])
    assert [m.digest for m in prompt.media] == alone
    assert [len(a[0]) for a in submitted] == [2, 2, 3]  # consecutive images, every one in exactly one task


def test_a_text_past_the_limit_is_refused_after_tokenizing_its_head_only():
    """Review (session 28): a text past `max_prompt_chars` is refused without tokenizing, but that bound (the
    vocabulary's longest entry a token) let 16 M characters through at a 32K context; a long text's head, cut at
    whitespace, is tokenized first and refuses it when it alone is past the limit. A text within the limit is
    tokenized whole, as before."""
    from prism.engine.inputs import InputProcessor, PromptTooLongError

    inputs = InputProcessor(ensure_tiny_checkpoint(), max_text_tokens=1000)
    encoded: list[int] = []
    encode = inputs.encode
    inputs.encode = lambda text: encoded.append(len(text)) or encode(text)
    with pytest.raises(PromptTooLongError, match="its first .* already more than 1000 tokens"):
        inputs.prepare_prompt("hello world " * 8_000)  # 96,000 characters (within max_prompt_chars), ~16,000 tokens
    assert encoded and max(encoded) <= 8 * (1000 + 16), f"tokenized {encoded} characters to refuse it"
    encoded.clear()
    dense = "a" * 30_000  # long, but its head (one word, no whitespace to cut at) proves nothing: tokenized whole
    inputs.prepare_prompt(dense)
    assert encoded[-1] == len(dense)


# ------------------------------------------------------------------------------------------ the images' pixel budget
def _budget_chat(*images, text="What is it?"):
    parts = [im if isinstance(im, dict) else {"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_images_past_max_image_pixels_are_refused_from_their_headers_before_any_is_decoded(ckpt, monkeypatch):
    """Three 40x40 PNGs against a budget of two: an ImagePixelBudgetError (an ImageTooLargeError: a 413 over HTTP)
    naming the limit, the total and the image that crosses it; nothing was decoded, nothing cached, no uuid bound.
    Two fit exactly."""
    from prism.media import image as media_image
    from prism.media.errors import ImagePixelBudgetError

    proc = InputProcessor(ckpt, model_id="tiny-budget", cache_bytes=2**26, max_image_pixels=2 * 40 * 40)
    assert proc.max_image_pixels == 3200
    pngs = [_png(im) for im in random_images([(40, 40)] * 3, seed=41)]
    decoded = []
    decode = media_image.decode_image
    monkeypatch.setattr(media_image, "decode_image", lambda data, limits: decoded.append(data) or decode(data, limits))
    sent = [{"type": "image", "image": p, "uuid": f"budget-{i}"} for i, p in enumerate(pngs)]
    with pytest.raises(ImagePixelBudgetError, match=r"4800 pixels in all; the limit is max_image_pixels=3200, crossed at "
                                                    r"image 2 \(40x40\)") as refused:
        proc.prepare_chat(_budget_chat(*sent))
    assert isinstance(refused.value, ImageTooLargeError)
    assert (refused.value.total, refused.value.limit, refused.value.index) == (4800, 3200, 2)
    assert not decoded and len(proc.cache) == 0
    assert all(proc.image_names.resolve(f"budget-{i}") is None for i in range(3))
    prompt = proc.prepare_chat(_budget_chat(*sent[:2]))
    assert len(prompt.media) == 2 and len(decoded) == 2 and proc.image_names.resolve("budget-0") is not None


def test_an_image_named_by_its_uuid_alone_counts_no_pixels(ckpt):
    """It carries none and costs no decoding (the image it names counted when it was sent); the same image sent with
    its pixels again counts, cached or not: the verdict depends on the request alone."""
    from prism.media.errors import ImagePixelBudgetError

    proc = InputProcessor(ckpt, model_id="tiny-budget-uuid", cache_bytes=2**26, max_image_pixels=40 * 40)
    a, b = (_png(im) for im in random_images([(40, 40)] * 2, seed=42))
    proc.prepare_chat(_budget_chat({"type": "image", "image": a, "uuid": "a"}))
    named = proc.prepare_chat(_budget_chat({"type": "image", "image": None, "uuid": "a"}, b))
    assert len(named.media) == 2
    with pytest.raises(ImagePixelBudgetError, match="3200 pixels in all"):
        proc.prepare_chat(_budget_chat(a, b))  # a is in the cache: it counts all the same


def test_pictures_and_arrays_count_their_size_and_a_memo_reads_no_header_again(ckpt, monkeypatch):
    """A PIL image and a uint8 array count width x height; PNG bytes their header's. A decide's questions share a
    memo: the images it prepared count the size they were decoded at, their headers not read again."""
    from prism.engine import media_preparation
    from prism.media.errors import ImagePixelBudgetError

    proc = InputProcessor(ckpt, model_id="tiny-budget-forms", max_image_pixels=32 * 24 + 20 * 10 + 16 * 16)
    picture, png = random_images([(32, 24), (16, 16)], seed=43)
    array = np.zeros((10, 20, 3), np.uint8)
    assert picture.size == (24, 32)  # random_images takes (height, width)
    reads = []
    header_size = media_preparation.header_size
    monkeypatch.setattr(media_preparation, "header_size", lambda data, limits: reads.append(data) or header_size(
        data, limits))
    material = _budget_chat(picture, array, _png(png))
    memo: dict = {}
    for question in ("One?", "Two?"):
        proc.prepare_chat([*material, {"role": "user", "content": question}], media_memo=memo)
    assert len(reads) == 1, "a memo's image had its header read again"
    with pytest.raises(ImagePixelBudgetError, match=r"crossed at image 3 \(1x1\)"):
        proc.prepare_chat(_budget_chat(picture, array, _png(png), np.zeros((1, 1, 3), np.uint8)), media_memo=memo)
    with pytest.raises(InputError, match="max_image_pixels must be a positive int"):
        InputProcessor(ckpt, max_image_pixels=0)
    with pytest.raises(InputError, match="max_video_pixels must be a positive int"):
        InputProcessor(ckpt, max_video_pixels=2.0**27)


def test_a_sampled_frame_whose_body_does_not_decode_is_named(proc):
    """Frames come encoded from the server, which read only their headers: a sampled frame whose pixels are cut short
    is a MediaDecodeError (a 400) naming it; one the video does not sample is never decoded, so it costs nothing."""
    frames = [_png(im) for im in random_images([(32, 24)] * 12, seed=17)]  # 30 fps: frames 0, 4, 7 and 11 sampled
    cut = frames[5][: len(frames[5]) // 2]
    chat = [{"role": "user", "content": [{"type": "video", "video": [*frames[:5], cut, *frames[6:]], "fps": 30.0}]}]
    assert len(proc.prepare_chat(chat).media) == 1
    chat[0]["content"][0]["video"] = [*frames[:4], cut, *frames[5:]]
    with pytest.raises(MediaDecodeError, match="^video frame 4 is not a decodable image: image data is truncated"):
        proc.prepare_chat(chat)
