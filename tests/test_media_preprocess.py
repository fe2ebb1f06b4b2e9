"""Image / video preprocessing parity with HF transformers 5.17 (no torchvision), and the error cases.

Images are compared end to end with `Qwen2VLImageProcessorPil` (Qwen3-VL settings, pixel limits scaled down
so every case stays tiny). HF's video processor needs torchvision, which does not install beside CPU torch,
so the video path is compared piecewise with HF's own pure functions: the Qwen3-VL video `smart_resize`,
`Qwen3VLVideoProcessor.sample_frames`, `.patchify` and `.get_num_of_video_patches`, and
`Qwen3VLProcessor._calculate_timestamps`.
"""

from __future__ import annotations

import io
import struct
import types
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_image_smart_resize
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_video_smart_resize
from transformers.video_utils import VideoMetadata

from prism.media.config import ImageProcessorConfig, VideoProcessorConfig
from prism.media.errors import (
    AspectRatioError,
    DecompressionBombError,
    ImageTooLargeError,
    ImageTooSmallError,
    MediaConfigError,
    MediaDecodeError,
    MediaError,
    VideoError,
)
from prism.media.image import DecodeLimits, decode_image, preprocess_image, smart_resize
from prism.media.pixels import PatchPixels, pixels_on
from prism.media.video import (
    frame_group_timestamps,
    preprocess_video,
    sample_frame_indices,
    timestamp_text,
    video_smart_resize,
)

FACTOR = 32
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _image_cfg(
    min_tokens: int, max_tokens: int, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)
) -> ImageProcessorConfig:
    return ImageProcessorConfig(
        patch_size=16,
        min_pixels=min_tokens * FACTOR * FACTOR,
        max_pixels=max_tokens * FACTOR * FACTOR,
        image_mean=mean,
        image_std=std,
    )


def _hf_image_processor(cfg: ImageProcessorConfig) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
    )


def _random_image(rng: np.random.Generator, h: int, w: int, mode: str) -> Image.Image:
    rgb = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), mode="L")
        rgba = rgb.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    return rgb if mode == "RGB" else rgb.convert(mode)


# ---------------------------------------------------------------- images vs HF


@settings(max_examples=100)
@given(
    h=st.integers(28, 400),
    w=st.integers(28, 400),
    min_tokens=st.integers(1, 8),
    extra_tokens=st.integers(0, 56),
    mode=st.sampled_from(["RGB", "RGBA", "L", "P"]),
    clip=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_image_matches_hf_pil_processor(h, w, min_tokens, extra_tokens, mode, clip, seed):
    cfg = _image_cfg(min_tokens, min_tokens + extra_tokens, *((CLIP_MEAN, CLIP_STD) if clip else ()))
    img = _random_image(np.random.default_rng(seed), h, w, mode)
    ours = preprocess_image(img, cfg)
    ref = _hf_image_processor(cfg)(images=[img])
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    ref_pixels = torch.from_numpy(np.asarray(ref["pixel_values"]))
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == ref_pixels.shape
    # Same PIL resize and the same numpy op order: the values are bit-identical, not just within 1e-5.
    assert torch.equal(ours.pixel_values, ref_pixels)
    # The engine keeps uint8 patches (a quarter of the bytes) and normalizes them where it encodes them.
    assert ours.pixels.patches.dtype == torch.uint8 and ours.pixels.patches.shape == ref_pixels.shape
    assert torch.equal(pixels_on(ours.pixels, "cpu"), ref_pixels)
    t, gh, gw = ours.grid_thw
    assert t == 1 and ours.resized_size == (gh * 16, gw * 16)
    assert ours.num_tokens(cfg.merge_size) == gh * gw // 4


@settings(max_examples=300)
@given(
    h=st.integers(1, 5000),
    w=st.integers(1, 5000),
    min_pixels=st.integers(1, 200_000),
    span=st.integers(0, 2_000_000),
    factor=st.sampled_from([28, 32]),
)
def test_smart_resize_matches_hf(h, w, min_pixels, span, factor):
    max_pixels = min_pixels + span
    try:
        expected = hf_image_smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError:
        with pytest.raises(AspectRatioError):
            smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        return
    got = smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    assert got == expected
    assert got[0] % factor == 0 and got[1] % factor == 0 and min(got) >= factor


def test_image_from_array_and_bytes_equal_pil_path():
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (90, 150, 3), dtype=np.uint8)
    cfg = _image_cfg(4, 20)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    from_pil = preprocess_image(Image.fromarray(arr), cfg)
    from_arr = preprocess_image(arr, cfg)
    from_png = preprocess_image(buf.getvalue(), cfg)
    assert torch.equal(from_pil.pixel_values, from_arr.pixel_values)
    assert torch.equal(from_pil.pixel_values, from_png.pixel_values)
    assert from_png.image_size == (90, 150)


def test_single_image_fills_the_temporal_patch():
    cfg = _image_cfg(4, 8)
    pre = preprocess_image(np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8), cfg)
    # Columns are (C, T, p, p): both temporal slices of every channel hold the same patch.
    x = pre.pixel_values.reshape(-1, 3, 2, 16 * 16)
    assert torch.equal(x[:, :, 0], x[:, :, 1])


def test_exif_orientation_applied_when_decoding_bytes():
    arr = np.random.default_rng(3).integers(0, 256, (40, 90, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", exif=exif.tobytes())
    decoded = decode_image(buf.getvalue())
    assert decoded.size == (40, 90)  # (width, height) swapped by the orientation tag
    assert np.array_equal(np.asarray(decoded), np.rot90(arr, k=-1))


# ---------------------------------------------------------------- image errors


def _png_bytes(h: int = 10, w: int = 10) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _png_with_header_size(width: int, height: int) -> bytes:
    data = bytearray(_png_bytes())
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_decompression_bomb_refused_from_header():
    # The header claims 50,000 x 50,000 pixels but carries 10x10 worth of data: decoding it would fail
    # as truncated, so DecompressionBombError proves the refusal came from the header alone.
    with pytest.raises(DecompressionBombError):
        decode_image(_png_with_header_size(50_000, 50_000))
    # Our own limit (not PIL's global one) governs, also below PIL's warning threshold.
    with pytest.raises(DecompressionBombError):
        decode_image(_png_with_header_size(2_000, 2_000), DecodeLimits(max_pixels=1_000_000))
    with pytest.raises(DecompressionBombError):
        preprocess_image(_png_bytes(40, 40), _image_cfg(1, 4), DecodeLimits(max_pixels=1_000))
    assert issubclass(DecompressionBombError, ImageTooLargeError)


def test_a_header_size_is_what_decoding_would_give_and_refuses_what_it_would_refuse():
    """`header_size` reads the header under decode_image's checks (the same errors), decoding nothing: a header
    claiming 3000 x 2000 over 10 x 10 pixels of data reads as 3000 x 2000 (decoding it fails as truncated)."""
    from prism.media.image import header_size

    assert header_size(_png_bytes(40, 30)) == decode_image(_png_bytes(40, 30)).size == (30, 40)
    assert header_size(_png_with_header_size(3_000, 2_000)) == (3_000, 2_000)
    with pytest.raises(MediaDecodeError, match="truncated"):
        decode_image(_png_with_header_size(3_000, 2_000))
    with pytest.raises(DecompressionBombError):
        header_size(_png_with_header_size(2_000, 2_000), DecodeLimits(max_pixels=1_000_000))
    with pytest.raises(ImageTooLargeError):
        header_size(_png_bytes(), DecodeLimits(max_bytes=10))
    with pytest.raises(MediaDecodeError, match="accepted"):
        header_size(b"definitely not an image")


def test_the_pixel_budget_refuses_a_total_past_it_naming_the_image_that_crosses_it():
    from prism.media.errors import ImagePixelBudgetError
    from prism.media.pixel_budget import DEFAULT_MAX_IMAGE_PIXELS, check_image_pixels

    assert DEFAULT_MAX_IMAGE_PIXELS == 16 * 4096 * 4096
    check_image_pixels([(4096, 4096)] * 16, DEFAULT_MAX_IMAGE_PIXELS)  # Qwen3-VL's largest image, 16 times
    check_image_pixels([(10, 10), None, (10, 10)], 200)  # None: named by uuid alone, no pixels
    check_image_pixels([], 1)
    with pytest.raises(ImagePixelBudgetError, match=r"the images of this request announce 300 pixels in all; "
                                                    r"the limit is max_image_pixels=200, crossed at image 3 \(10x10\)"):
        check_image_pixels([(10, 10), None, (10, 10), (10, 10)], 200)
    with pytest.raises(ImagePixelBudgetError) as refused:
        check_image_pixels([(4096, 4096)] * 16 + [(1, 1)], DEFAULT_MAX_IMAGE_PIXELS)
    assert (refused.value.total, refused.value.index) == (DEFAULT_MAX_IMAGE_PIXELS + 1, 16)
    assert issubclass(ImagePixelBudgetError, ImageTooLargeError)  # a 413 over HTTP, as the per-image limit


def test_bad_bytes_raise_typed_errors():
    with pytest.raises(MediaDecodeError):
        decode_image(b"definitely not an image")
    with pytest.raises(MediaDecodeError):
        decode_image(b"")
    with pytest.raises(MediaDecodeError):
        decode_image(_png_bytes(64, 64)[:60])  # truncated inside the pixel data
    with pytest.raises(MediaDecodeError):
        decode_image("a string")  # type: ignore[arg-type]
    with pytest.raises(ImageTooLargeError):
        decode_image(_png_bytes(), DecodeLimits(max_bytes=10))


EPS_BYTES = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"


def test_an_eps_is_refused_without_running_ghostscript(monkeypatch):
    """Before: Pillow opened any format it knows, and decoding an EPS ran Ghostscript (`gs`, from PATH) on the
    client's bytes; here Pillow is told Ghostscript is installed and every process start is recorded."""
    import subprocess

    from PIL import EpsImagePlugin

    started = []

    def record(args, *a, **k):
        started.append(args)
        raise OSError("no process may start while an image is decoded")

    monkeypatch.setattr(EpsImagePlugin, "gs_binary", "gs")
    monkeypatch.setattr(subprocess, "Popen", record)
    with pytest.raises(MediaDecodeError, match="PNG"):
        decode_image(EPS_BYTES)
    assert started == []


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "PPM", "TGA"])
def test_the_common_formats_decode(fmt):
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (12, 16, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    assert decode_image(buf.getvalue()).size == (16, 12)


def test_a_multi_picture_jpeg_decodes():
    """Phones write MPO (JPEG with a second picture): Pillow opens it through its JPEG plugin."""
    img = Image.new("RGB", (16, 12), (9, 8, 7))
    buf = io.BytesIO()
    img.save(buf, format="MPO", save_all=True, append_images=[img])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    assert decode_image(buf.getvalue()).size == (16, 12)


def test_size_and_aspect_errors():
    cfg = _image_cfg(1, 16)
    with pytest.raises(AspectRatioError):
        preprocess_image(np.zeros((1, 300, 3), np.uint8), cfg)
    with pytest.raises(AspectRatioError):
        preprocess_image(Image.new("RGB", (5, 1100)), cfg)
    with pytest.raises(ImageTooSmallError):
        preprocess_image(np.zeros((0, 20, 3), np.uint8), cfg)
    with pytest.raises(ImageTooSmallError):
        preprocess_image(np.zeros((3, 20, 3), np.uint8), cfg, DecodeLimits(min_side=4))
    with pytest.raises(ImageTooSmallError):
        smart_resize(10, 10, factor=32, min_pixels=0, max_pixels=1024)  # rounds to an empty grid
    with pytest.raises(ImageTooLargeError):
        preprocess_image(np.zeros((100, 100, 3), np.uint8), cfg, DecodeLimits(max_pixels=9_999))
    with pytest.raises(MediaError):
        preprocess_image(np.zeros((10, 10, 3), np.float32), cfg)
    with pytest.raises(MediaError):
        preprocess_image(np.zeros((10, 10, 4), np.uint8), cfg)
    with pytest.raises(MediaError):
        preprocess_image(12345, cfg)  # type: ignore[arg-type]


# ---------------------------------------------------------------- configs


QWEN3_VL_IMAGE_JSON = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def test_image_config_from_checkpoint_json(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(__import__("json").dumps(QWEN3_VL_IMAGE_JSON))
    cfg = ImageProcessorConfig.from_json_file(path)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels, cfg.factor) == (16, 65536, 16777216, 32)
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.temporal_patch_size == 2 and cfg.merge_size == 2
    # Top-level min/max_pixels override size{}, as in HF's processor __init__.
    cfg2 = ImageProcessorConfig.from_dict({**QWEN3_VL_IMAGE_JSON, "max_pixels": 1 << 20})
    assert cfg2.max_pixels == 1 << 20 and cfg2.fingerprint() != cfg.fingerprint()
    assert ImageProcessorConfig.from_dict(dict(QWEN3_VL_IMAGE_JSON)).fingerprint() == cfg.fingerprint()


@pytest.mark.parametrize(
    "patch",
    [
        {"patch_size": None},  # removed below: required key missing
        {"unknown_key": 1},
        {"do_normalize": False},
        {"resample": 2},
        {"image_mean": [0.5, 0.5]},
        {"image_std": [0.5, 0.0, 0.5]},
        {"size": {"shortest_edge": 10_000, "longest_edge": 100}},
        {"size": {"height": 10}},
        {"merge_size": 0},
    ],
)
def test_image_config_rejects_bad_settings(patch):
    raw = {**QWEN3_VL_IMAGE_JSON, **patch}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(MediaConfigError):
        ImageProcessorConfig.from_dict(raw)


def test_video_config_defaults_are_hf_qwen3vl_defaults():
    cfg = VideoProcessorConfig.from_dict({"processor_class": "Qwen3VLProcessor"})
    hf = Qwen3VLVideoProcessor
    assert cfg.patch_size == hf.patch_size and cfg.temporal_patch_size == hf.temporal_patch_size
    assert cfg.merge_size == hf.merge_size and cfg.fps == hf.fps
    assert (cfg.min_frames, cfg.max_frames, cfg.max_video_tokens) == (
        hf.min_frames,
        hf.max_frames,
        hf.max_video_tokens,
    )
    assert (cfg.min_pixels, cfg.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert list(cfg.image_mean) == list(hf.image_mean) and list(cfg.image_std) == list(hf.image_std)
    with pytest.raises(MediaConfigError):
        VideoProcessorConfig.from_dict({"frames_per_second": 3})
    with pytest.raises(MediaConfigError):
        VideoProcessorConfig(fps=-1.0)


# ---------------------------------------------------------------- video vs HF functions


def _hf_video_stub(cfg: VideoProcessorConfig) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        fps=cfg.fps,
        min_frames=cfg.min_frames,
        max_frames=cfg.max_frames,
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels},
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        cap_pixels_per_frame=cfg.cap_pixels_per_frame,
        max_video_tokens=cfg.max_video_tokens,
    )


@settings(max_examples=300)
@given(
    frames=st.integers(1, 64),
    h=st.integers(1, 2000),
    w=st.integers(1, 2000),
    min_pixels=st.integers(1, 400_000),
    span=st.integers(0, 5_000_000),
)
def test_video_smart_resize_matches_hf(frames, h, w, min_pixels, span):
    kwargs = dict(temporal_factor=2, factor=32, min_pixels=min_pixels, max_pixels=min_pixels + span)
    try:
        expected = hf_video_smart_resize(frames, h, w, **kwargs)
    except ValueError:
        with pytest.raises((AspectRatioError, VideoError)):
            video_smart_resize(frames, h, w, **kwargs)
        return
    assert video_smart_resize(frames, h, w, **kwargs) == expected


@settings(max_examples=200)
@given(
    total=st.integers(1, 600),
    video_fps=st.floats(1.0, 60.0),
    target=st.one_of(st.none(), st.floats(0.25, 8.0)),
    num_frames=st.one_of(st.none(), st.integers(1, 40)),
    min_frames=st.integers(1, 8),
    max_frames=st.integers(8, 64),
)
def test_sampling_and_timestamps_match_hf(total, video_fps, target, num_frames, min_frames, max_frames):
    cfg = VideoProcessorConfig(min_frames=min_frames, max_frames=max_frames)
    if target is not None and num_frames is not None:
        with pytest.raises(VideoError):
            sample_frame_indices(total, video_fps, cfg, fps=target, num_frames=num_frames)
        return
    if num_frames is not None and num_frames > max_frames:  # HF samples any count; ours stops at the processor's most
        with pytest.raises(VideoError, match=f"num_frames={num_frames} .* max_frames={max_frames}"):
            sample_frame_indices(total, video_fps, cfg, num_frames=num_frames)
        return
    meta = VideoMetadata(total_num_frames=total, fps=video_fps)
    expected = Qwen3VLVideoProcessor.sample_frames(
        _hf_video_stub(cfg), meta, num_frames=num_frames, fps=target
    )
    got = sample_frame_indices(total, video_fps, cfg, fps=target, num_frames=num_frames)
    assert got.dtype == np.int64 and got.tolist() == np.asarray(expected).tolist()
    hf_ts = Qwen3VLProcessor._calculate_timestamps(None, got.tolist(), video_fps, 2)
    ours = frame_group_timestamps(got, video_fps, 2)
    assert ours == hf_ts  # exact float equality: same arithmetic
    assert [timestamp_text(t) for t in ours] == [f"<{t:.1f} seconds>" for t in hf_ts]


@settings(max_examples=25)
@given(
    n_frames=st.integers(2, 9),
    h=st.integers(20, 120),
    w=st.integers(20, 120),
    cap=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_video_layout_matches_hf_patchify(n_frames, h, w, cap, seed):
    cfg = VideoProcessorConfig(
        min_pixels=2 * FACTOR * FACTOR,
        max_pixels=12 * FACTOR * FACTOR,
        cap_pixels_per_frame=cap,
        max_video_tokens=3,
    )
    rng = np.random.default_rng(seed)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n_frames)]
    video = preprocess_video(frames, 10.0, cfg, sample=False)
    rh, rw = video.resized_size
    # Resize exactly as we do (PIL bicubic; HF uses torchvision here), then HF's fused rescale+normalize
    # arithmetic and HF's own patchify (which also pads odd frame counts with the last frame).
    resized = np.stack(
        [np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.BICUBIC)) for f in frames]
    )
    tensor = torch.from_numpy(resized).permute(0, 3, 1, 2).float()[None]
    tensor = (tensor - 0.5 * 255) / (0.5 * 255)
    ref, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
        None, tensor, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert video.grid_thw == (gt, gh, gw)
    assert video.pixel_values_videos.shape == ref[0].shape
    torch.testing.assert_close(video.pixel_values_videos, ref[0], atol=1e-5, rtol=0)
    assert len(video.timestamps) == gt and video.frame_indices == tuple(range(n_frames))
    if n_frames % 2 == 0:  # HF's own token count (it floors odd frame counts, its patchify pads them)
        count = Qwen3VLVideoProcessor.get_num_of_video_patches(_hf_video_stub(cfg), n_frames, h, w, {})
        assert count == gt * gh * gw


def test_video_sampling_end_to_end():
    cfg = VideoProcessorConfig(min_pixels=2 * FACTOR * FACTOR, max_pixels=16 * FACTOR * FACTOR)
    frames = [Image.new("RGB", (64, 48), (i, i, i)) for i in range(30)]  # 30 frames at 10 fps = 3 s
    video = preprocess_video(frames, 10.0, cfg)  # default 2 fps -> 6 frames -> 3 temporal patches
    assert video.frame_indices == tuple(np.linspace(0, 29, 6).round().astype(int).tolist())
    assert video.grid_thw[0] == 3
    assert video.timestamp_texts() == [
        timestamp_text(t) for t in frame_group_timestamps(video.frame_indices, 10.0, 2)
    ]
    # Each temporal patch holds its two sampled frames, in order: the constant gray level shows which.
    x = video.pixel_values_videos.reshape(3, -1, 3, 2, 256)
    levels = ((x[:, 0, 0, :, 0] * 0.5 + 0.5) * 255).round().to(torch.int64)
    assert levels.reshape(-1).tolist() == list(video.frame_indices)


def test_video_errors():
    cfg = VideoProcessorConfig()
    frame = np.zeros((40, 40, 3), np.uint8)
    with pytest.raises(VideoError):
        preprocess_video([], 10.0, cfg)
    with pytest.raises(VideoError):
        preprocess_video([frame], 10.0, cfg)  # one sampled frame < temporal patch
    with pytest.raises(VideoError):
        preprocess_video([frame, np.zeros((40, 48, 3), np.uint8)], 10.0, cfg, sample=False)
    with pytest.raises(VideoError):
        preprocess_video([frame] * 4, 0.0, cfg)
    with pytest.raises(VideoError):
        preprocess_video([frame] * 4, None, cfg)  # type: ignore[arg-type]
    with pytest.raises(VideoError):
        preprocess_video("frames", 10.0, cfg)  # type: ignore[arg-type]
    with pytest.raises(AspectRatioError):
        preprocess_video([np.zeros((2, 600, 3), np.uint8)] * 4, 10.0, cfg, sample=False)


@pytest.mark.parametrize("fps", [5e-324, 1e-310, 4e-308, 1e-300, 1e-15])
@pytest.mark.parametrize("sample", [True, False])
def test_a_video_fps_too_small_for_its_duration_is_a_video_error(fps, sample):
    """Before: `int(total / fps * target)` overflowed to an OverflowError (a 500 over HTTP) once the frame count
    over the frame rate left the floats; and short of that, a frame time past 2**49 s (where a float no longer tells
    tenths of a second apart) was rendered as a timestamp of up to 309 digits."""
    frame = np.zeros((40, 40, 3), np.uint8)
    with pytest.raises(VideoError, match="fps"):
        preprocess_video([frame] * 4, fps, VideoProcessorConfig(), sample=sample)


def test_timestamps_up_to_a_tenth_of_a_second_apart_are_kept():
    """The last timestamp below 2**49 s is HF's and its text is HF's; from 2**49 s on, the video is refused."""
    frame = np.zeros((40, 40, 3), np.uint8)
    fps = float(np.nextafter(2.0**-50, 1))  # frames at 0 and 2**50 - 1/4 s: one timestamp, 2**49 - 1/8 s
    video = preprocess_video([frame] * 2, fps, VideoProcessorConfig(), sample=False)
    (stamp,) = video.timestamps
    assert stamp == Qwen3VLProcessor._calculate_timestamps(None, [0, 1], fps, 2)[0] == 2.0**49 - 0.125
    assert video.timestamp_texts() == [f"<{stamp:.1f} seconds>"]
    with pytest.raises(VideoError, match=r"2\*\*49 seconds"):
        preprocess_video([frame] * 2, 1 / 2.0**50, VideoProcessorConfig(), sample=False)  # stamp (0 + 2**50) / 2


def test_patch_pixels_are_checked():
    table = torch.zeros(3, 256)
    with pytest.raises(ValueError, match="uint8"):
        PatchPixels(torch.zeros(4, 4, 3), table, 2, 2, 2)
    with pytest.raises(ValueError, match="not cut"):
        PatchPixels(torch.zeros(4, 6, 3, dtype=torch.uint8), table, 2, 2, 2)
    with pytest.raises(ValueError, match="does not fit"):
        PatchPixels(torch.zeros(4, 4, 3, dtype=torch.uint8), torch.zeros(1, 256), 2, 2, 2)
    with pytest.raises(ValueError, match="does not fit"):
        PatchPixels(torch.zeros(4, 4, 5, dtype=torch.uint8), table, 2, 2, 2)
    with pytest.raises(ValueError, match="does not fit"):
        PatchPixels(torch.zeros(4, 4, 3, dtype=torch.uint8), torch.zeros(3, 255), 2, 2, 2)
    # one 2x2 patch (merge 1), repeated over two frames: columns channel-major (C, T, p, p), each level looked up
    # in its channel's row of the table
    frame = torch.arange(12, dtype=torch.uint8).reshape(2, 2, 3)
    table = torch.arange(3 * 256, dtype=torch.float32).reshape(3, 256)
    pixels = PatchPixels(frame, table, 2, 1, 2)
    red = [0.0, 3.0, 6.0, 9.0]
    assert pixels.normalized().tolist() == [red * 2 + [256 + v + 1 for v in red] * 2 + [512 + v + 2 for v in red] * 2]
    assert pixels.shape == pixels.patches.shape == (1, 24)
    # the layout images are kept in: a padding byte after each pixel's levels, never looked up
    padded = PatchPixels(torch.cat([frame, torch.full((2, 2, 1), 255, dtype=torch.uint8)], dim=2), table, 2, 1, 2)
    assert torch.equal(padded.normalized(), pixels.normalized()) and torch.equal(padded.patches, pixels.patches)
    assert padded.shape == pixels.shape


@pytest.mark.parametrize("size", [(64, 96), (448, 448), (96, 160)])
def test_patchify_frame_is_the_numpy_patchify_of_the_repeated_frame(size):
    from prism.media.image import patchify
    from prism.media.pixels import patchify_frame

    frame = np.random.default_rng(sum(size)).integers(0, 256, (*size, 3), dtype=np.uint8)
    want, grid = patchify(np.broadcast_to(frame[None], (2, *frame.shape)), patch_size=16, merge_size=2,
                          temporal_patch_size=2)
    got = patchify_frame(torch.from_numpy(frame), 16, 2, 2)
    assert grid == (1, size[0] // 16, size[1] // 16)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_images_goes_to_the_device_as_each_would(dtype):
    """`batch_pixels_on` (one upload, one lookup for all frames) is bitwise each image's own pixel values joined;
    a video's float32 patches or another table among the items take the per-item path, with the same result."""
    from prism.media.pixels import batch_pixels_on

    cfg = _image_cfg(4, 64 * 96)
    rng = np.random.default_rng(1)
    images = [preprocess_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), cfg).pixels
              for h, w in ((64, 96), (32, 64), (64, 64))]

    def each(items):
        return torch.cat([pixels_on(p, "cpu") for p in items]).to(dtype)

    assert torch.equal(batch_pixels_on(images, "cpu", dtype), each(images))
    same = PatchPixels(images[1].frame, images[1].table.clone(), 16, 2, 2)  # an equal table, another object
    assert torch.equal(batch_pixels_on([images[0], same], "cpu", dtype), each([images[0], same]))
    other = PatchPixels(images[1].frame, images[1].table * 2, 16, 2, 2)
    unpadded = PatchPixels(images[1].frame[..., :3].contiguous(), images[1].table, 16, 2, 2)  # 3 bytes a pixel
    video = torch.randn(8, images[0].shape[1])
    for mixed in ([images[0], other], [images[0], video, images[2]], [images[0], unpadded, images[2]]):
        assert torch.equal(batch_pixels_on(mixed, "cpu", dtype), each(mixed))
    # tables equal by value but not by bits (0.0 and -0.0) are not shared: each image keeps its own bits
    plus = images[1].table.clone()
    plus[0, 0] = 0.0
    minus = plus.clone()
    minus[0, 0] = -0.0
    frame = images[1].frame.clone()
    frame[0, 0, 0] = 0
    signed = [PatchPixels(frame, plus, 16, 2, 2), PatchPixels(frame, minus, 16, 2, 2)]
    assert torch.equal(batch_pixels_on(signed, "cpu", dtype).view(torch.uint8), each(signed).view(torch.uint8))


def test_the_cached_frame_is_not_the_callers_array():
    cfg = _image_cfg(4, 64)
    array = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    before = preprocess_image(array, cfg)
    kept = before.pixels.normalized().clone()
    array[:] = 0  # the caller reuses its buffer
    assert torch.equal(before.pixels.normalized(), kept)


@pytest.mark.parametrize("size", [(64, 96), (448, 448)])
@pytest.mark.parametrize("as_array", [False, True])
def test_an_image_already_at_its_target_size_matches_hf(size, as_array):
    """No resize is needed (both sides multiples of 32, the area in range): the pixels are taken as they are,
    which is what PIL's same-size resize returns; HF resizes anyway. Bitwise the same patches."""
    h, w = size
    cfg = _image_cfg(1, 16384)
    img = _random_image(np.random.default_rng(h * w), h, w, "RGB")
    ours = preprocess_image(np.asarray(img) if as_array else img, cfg)
    assert ours.resized_size == (h, w)
    ref = _hf_image_processor(cfg)(images=[img])
    assert torch.equal(ours.pixel_values, torch.from_numpy(np.asarray(ref["pixel_values"])))
