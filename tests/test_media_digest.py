"""Content digests (same decoded pixels <=> same digest, framed fields) and the preprocessing LRU cache."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, PngImagePlugin, features

from prism.media.cache import CacheKey, PreprocessCache
from prism.media.config import ImageProcessorConfig, VideoProcessorConfig
from prism.media.digest import DIGEST_SIZE, image_digest, media_digest, raw_digest, video_digest
from prism.media.errors import MediaError
from prism.media.image import preprocess_image
from prism.media.prepare import PreparedImage, media_namespace, prepare_image
from prism.media.video import preprocess_video

MODEL = "Qwen/Qwen3-VL-8B-Instruct"
CFG = ImageProcessorConfig(
    patch_size=16, min_pixels=4 * 1024, max_pixels=24 * 1024, image_mean=(0.5,) * 3, image_std=(0.5,) * 3
)


def _encode(arr: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _lossless_encodings(arr: np.ndarray) -> list[bytes]:
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "same pixels, other bytes")
    out = [
        _encode(arr, "PNG", compress_level=0),
        _encode(arr, "PNG", compress_level=9),
        _encode(arr, "PNG", pnginfo=info),
        _encode(arr, "BMP"),
        _encode(arr, "TIFF"),
        _encode(arr, "PPM"),
    ]
    if features.check("webp"):
        out.append(_encode(arr, "WEBP", lossless=True, quality=100))
    return out


def _digest_of(data: bytes, cfg: ImageProcessorConfig = CFG, model: str = MODEL) -> bytes:
    return image_digest(preprocess_image(data, cfg), model_id=model, config=cfg)


def test_same_pixels_in_any_lossless_file_give_one_digest():
    arr = np.random.default_rng(0).integers(0, 256, (70, 110, 3), dtype=np.uint8)
    files = _lossless_encodings(arr)
    assert len({raw_digest(f) for f in files}) == len(files)  # the files differ byte-wise
    digests = {_digest_of(f) for f in files}
    assert len(digests) == 1
    (d,) = digests
    assert isinstance(d, bytes) and len(d) == DIGEST_SIZE >= 16
    # A lossy JPEG of the same picture decodes to other pixels, so it is other content.
    assert _digest_of(_encode(arr, "JPEG", quality=90)) != d


@settings(max_examples=25)
@given(y=st.integers(0, 63), x=st.integers(0, 95), c=st.integers(0, 2), delta=st.integers(1, 255))
def test_any_pixel_change_changes_the_digest(y, x, c, delta):
    # The digest covers the pixels the encoder sees; at a size smart resize keeps (64x96 is a multiple of
    # 32 within the limits) every decoded pixel reaches pixel_values unchanged, so any change must show.
    arr = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    base = image_digest(preprocess_image(arr, CFG), model_id=MODEL, config=CFG)
    changed = arr.copy()
    changed[y, x, c] = (int(changed[y, x, c]) + delta) % 256
    pre = preprocess_image(changed, CFG)
    assert pre.resized_size == (64, 96)
    assert image_digest(pre, model_id=MODEL, config=CFG) != base


def test_settings_and_model_change_the_digest():
    arr = np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    base = _digest_of(_encode(arr, "PNG"))
    # Same grid and even the same resized pixels, only the namespace differs:
    roomier = ImageProcessorConfig(**{**CFG.__dict__, "max_pixels": CFG.max_pixels + 1024})
    assert preprocess_image(arr, roomier).grid_thw == preprocess_image(arr, CFG).grid_thw
    assert _digest_of(_encode(arr, "PNG"), roomier) != base
    other_mean = ImageProcessorConfig(**{**CFG.__dict__, "image_mean": (0.5, 0.5, 0.49)})
    assert _digest_of(_encode(arr, "PNG"), other_mean) != base
    assert _digest_of(_encode(arr, "PNG"), model="Qwen/Qwen3-VL-2B-Instruct") != base


def test_fields_are_length_framed():
    px = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    common = dict(kind="image")
    a = media_digest(px, (1, 1, 2), model_id="ab", settings="c", **common)
    b = media_digest(px, (1, 1, 2), model_id="a", settings="bc", **common)
    assert a != b  # unframed concatenation "abc" would collide
    # Same bytes, other shape or dtype view: other digest.
    assert media_digest(px.reshape(3, 8), (1, 1, 2), model_id="a", settings="b", **common) != media_digest(
        px, (1, 1, 2), model_id="a", settings="b", **common
    )
    as_int = px.view(torch.int32)
    assert media_digest(as_int, (1, 1, 2), model_id="a", settings="b", **common) != media_digest(
        px, (1, 1, 2), model_id="a", settings="b", **common
    )
    assert media_digest(px, (1, 2, 1), model_id="a", settings="b", **common) != media_digest(
        px, (1, 1, 2), model_id="a", settings="b", **common
    )
    # Deterministic, and numpy / torch inputs of the same values agree.
    assert media_digest(px.numpy(), (1, 1, 2), model_id="a", settings="b", **common) == media_digest(
        px, (1, 1, 2), model_id="a", settings="b", **common
    )
    assert raw_digest(b"ab") != raw_digest(b"ab\x00") and len(raw_digest(b"")) == DIGEST_SIZE
    with pytest.raises(MediaError):
        media_digest(px, (1, 1, 2), model_id="a", settings="b", kind="audio")
    with pytest.raises(MediaError):
        media_digest(px, (0, 1, 2), model_id="a", settings="b", kind="image")
    with pytest.raises(MediaError):
        media_digest(px, (1, 1, 2), model_id="a", settings="b", kind="video")  # timestamps missing
    with pytest.raises(MediaError):
        raw_digest("text")  # type: ignore[arg-type]


def test_video_digest_covers_timestamps():
    cfg = VideoProcessorConfig(min_pixels=2 * 1024, max_pixels=16 * 1024)
    frames = [np.full((48, 64, 3), i * 20, np.uint8) for i in range(4)]
    a = preprocess_video(frames, 4.0, cfg, sample=False)
    b = preprocess_video(frames, 8.0, cfg, sample=False)  # same pixels, other frame times
    assert torch.equal(a.pixel_values_videos, b.pixel_values_videos) and a.timestamps != b.timestamps
    assert video_digest(a, model_id=MODEL, config=cfg) != video_digest(b, model_id=MODEL, config=cfg)
    assert video_digest(a, model_id=MODEL, config=cfg) == video_digest(
        preprocess_video(frames, 4.0, cfg, sample=False), model_id=MODEL, config=cfg
    )


# ---------------------------------------------------------------- cache


def _key(i: int, ns: str = "ns") -> CacheKey:
    return CacheKey(raw_digest(str(i).encode()), ns)


def test_lru_eviction_by_bytes_and_counters():
    cache: PreprocessCache[str] = PreprocessCache(max_bytes=100)
    assert cache.put(_key(1), "a", 40) and cache.put(_key(2), "b", 40)
    assert cache.get(_key(1)) == "a"  # 1 becomes most recent
    assert cache.put(_key(3), "c", 40)  # evicts 2 (least recent)
    assert _key(2) not in cache and _key(1) in cache and _key(3) in cache
    assert cache.get(_key(2)) is None
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions, s.entries, s.bytes) == (1, 1, 1, 2, 80)
    assert not cache.put(_key(4), "too big", 101)  # larger than the whole cache: not stored
    assert _key(4) not in cache and cache.stats().bytes == 80
    assert cache.put(_key(1), "a2", 10)  # refresh replaces the size
    assert cache.stats().bytes == 50 and cache.get(_key(1)) == "a2"
    assert cache.get(_key(1, "other settings")) is None  # the namespace is part of the key
    cache.clear()
    assert len(cache) == 0 and cache.stats().bytes == 0
    with pytest.raises(MediaError):
        PreprocessCache(max_bytes=-1)
    with pytest.raises(MediaError):
        cache.put(_key(1), "x", -5)


def test_cache_is_thread_safe():
    cache: PreprocessCache[int] = PreprocessCache(max_bytes=64)
    calls = 0
    lock = threading.Lock()

    def compute(i: int):
        nonlocal calls
        with lock:
            calls += 1
        return i * i, 8

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in rng.integers(0, 16, 300).tolist():
            assert cache.get_or_compute(_key(i), lambda i=i: compute(i)) == i * i

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert s.hits + s.misses == 4 * 300 and s.misses == calls
    assert s.bytes == 8 * s.entries <= 64 and s.entries <= 8


def test_prepare_image_uses_the_cache_and_content_digest():
    arr = np.random.default_rng(3).integers(0, 256, (50, 80, 3), dtype=np.uint8)
    png, bmp = _encode(arr, "PNG"), _encode(arr, "BMP")
    cache: PreprocessCache[PreparedImage] = PreprocessCache(max_bytes=10 * 1024 * 1024)
    first = prepare_image(png, CFG, model_id=MODEL, cache=cache)
    again = prepare_image(png, CFG, model_id=MODEL, cache=cache)
    assert again is first and cache.stats().hits == 1 and cache.stats().misses == 1
    other_file = prepare_image(bmp, CFG, model_id=MODEL, cache=cache)  # other bytes: a miss ...
    assert cache.stats().misses == 2 and other_file.raw_digest != first.raw_digest
    assert other_file.digest == first.digest  # ... but the same content
    assert torch.equal(other_file.pixel_values, first.pixel_values)
    assert first.digest == _digest_of(png) and first.raw_digest == raw_digest(png)
    assert first.num_tokens(CFG.merge_size) == first.grid_thw[1] * first.grid_thw[2] // 4
    # Other settings: another namespace, so no stale hit.
    roomier = ImageProcessorConfig(**{**CFG.__dict__, "max_pixels": CFG.max_pixels * 2})
    assert media_namespace(MODEL, roomier) != media_namespace(MODEL, CFG)
    prepare_image(png, roomier, model_id=MODEL, cache=cache)
    assert cache.stats().misses == 3
    with pytest.raises(MediaError):
        prepare_image(b"junk", CFG, model_id=MODEL, cache=cache)
    assert cache.stats().entries == 3  # a failed decode stores nothing
