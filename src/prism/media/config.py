"""Typed image / video processor settings read from a checkpoint's preprocessor configs.

Owns: the one place where `preprocessor_config.json` / `video_preprocessor_config.json` keys are
interpreted, validated (unknown keys fail loudly) and turned into a canonical fingerprint string
that namespaces media digests and preprocessing-cache keys (a setting change must change both).

Defaults policy: a field has a default only where HF transformers 5.17's class default equals the
Qwen3-VL checkpoint value.
- Image (`Qwen2VLImageProcessorPil` defaults: patch 14, CLIP mean/std, 56*56..28*28*1280 pixels) differs
  from Qwen3-VL (patch 16, mean/std 0.5, 65536..16777216 pixels) in patch_size, mean, std, min/max pixels:
  those are REQUIRED. temporal_patch_size=2, merge_size=2 and rescale_factor=1/255 are shared defaults.
- Video (`Qwen3VLVideoProcessor` defaults are Qwen3-VL's own): patch 16, temporal 2, merge 2, mean/std 0.5,
  min/max pixels 128*32*32 / 768*32*32 (total over the sampled frames), fps 2, min_frames 4,
  max_frames 768, max_video_tokens 768, and cap_pixels_per_frame False (5.17's effective default). A `num_frames`
  (a frame count every video is sampled to) past `max_frames` is refused, as a request's is (`media.video`): HF
  would sample any count, 10**9 filling the memory at the first video. An `fps` that is not a positive finite number
  at most `media.rates.MAX_SAMPLING_FPS` is refused, by the check a request's rates get (`media.rates`): inf loaded,
  and every video was then refused, blamed on its `video_fps`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MediaConfigError
from .rates import checked_sampling_rate

PIL_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC; the only resample HF's Qwen processors use

# Keys that describe the file rather than the processing: accepted and ignored.
_METADATA_KEYS = frozenset(
    {
        "processor_class",
        "image_processor_type",
        "video_processor_type",
        "feature_extractor_type",
        "image_processor_class",
        "auto_map",
        "_processor_class",
        "default_to_square",
        "data_format",
        "input_data_format",
        "return_tensors",
        "device",
        "disable_grouping",
        "return_metadata",
        "max_image_size",
        "max_duration",
        "video_metadata",
    }
)
# Boolean switches our pipeline always applies; a config turning one off is unsupported, not ignored.
_MUST_BE_TRUE = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
_MUST_BE_FALSE = ("do_center_crop", "do_pad")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MediaConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _triple(name: str, value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise MediaConfigError(f"{name} must be 3 numbers (one per RGB channel), got {value!r}")
    out = tuple(float(v) for v in value)
    if not all(math.isfinite(v) for v in out):
        raise MediaConfigError(f"{name} must be finite, got {value!r}")
    return out  # type: ignore[return-value]


def _common_checks(cfg: Any) -> None:
    for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
        _positive_int(name, getattr(cfg, name))
    if cfg.min_pixels > cfg.max_pixels:
        raise MediaConfigError(f"min_pixels {cfg.min_pixels} > max_pixels {cfg.max_pixels}")
    _triple("image_mean", cfg.image_mean)
    std = _triple("image_std", cfg.image_std)
    if any(s <= 0 for s in std):
        raise MediaConfigError(f"image_std must be > 0, got {std}")
    if not (
        isinstance(cfg.rescale_factor, float) and cfg.rescale_factor > 0 and math.isfinite(cfg.rescale_factor)
    ):
        raise MediaConfigError(f"rescale_factor must be a positive float, got {cfg.rescale_factor!r}")


def _fingerprint(kind: str, cfg: Any) -> str:
    # Canonical JSON: sorted keys, no spaces; floats use repr (exact round trip), so equal settings
    # give equal strings and any change gives a different one.
    payload = {"kind": kind, **dataclasses.asdict(cfg)}
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))


def _parse(raw: Mapping[str, Any], field_names: set[str], where: str) -> dict[str, Any]:
    """Translate HF config keys into dataclass kwargs; reject unknown keys and unsupported switches."""
    if not isinstance(raw, Mapping):
        raise MediaConfigError(f"{where}: config must be a JSON object, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    size: dict[str, Any] = {}
    top_pixels: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _METADATA_KEYS:
            continue
        if key in _MUST_BE_TRUE:
            if value is not True:
                raise MediaConfigError(f"{where}: {key}={value!r} is not supported (must be true)")
            continue
        if key in _MUST_BE_FALSE:
            if value not in (False, None):
                raise MediaConfigError(f"{where}: {key}={value!r} is not supported (must be false)")
            continue
        if key == "resample":
            if value != PIL_BICUBIC:
                raise MediaConfigError(f"{where}: resample={value!r} is not supported (only bicubic = 3)")
            continue
        if key == "size":
            if not isinstance(value, Mapping):
                raise MediaConfigError(f"{where}: size must be an object, got {value!r}")
            for skey, sval in value.items():
                if skey in ("shortest_edge", "min_pixels"):
                    size["min_pixels"] = sval
                elif skey in ("longest_edge", "max_pixels"):
                    size["max_pixels"] = sval
                else:
                    raise MediaConfigError(f"{where}: unknown size key {skey!r}")
            continue
        if key in ("min_pixels", "max_pixels"):
            if value is not None:
                top_pixels[key] = value
            continue
        if key in ("image_mean", "image_std"):
            kwargs[key] = _triple(key, value)
            continue
        if key == "rescale_factor":
            kwargs[key] = float(value)
            continue
        if key in field_names:
            kwargs[key] = value
            continue
        raise MediaConfigError(f"{where}: unknown key {key!r}")
    # HF's processors let top-level min_pixels / max_pixels override size{}: keep that precedence.
    kwargs.update(size)
    kwargs.update(top_pixels)
    return kwargs


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Qwen image preprocessing settings (smart resize -> rescale -> normalize -> patchify)."""

    patch_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    temporal_patch_size: int = 2
    merge_size: int = 2
    rescale_factor: float = 1.0 / 255.0
    # Not an HF setting: the most LM tokens one image may become (the engine's step; `within_tokens`).
    step_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", _triple("image_mean", self.image_mean))
        object.__setattr__(self, "image_std", _triple("image_std", self.image_std))
        _common_checks(self)
        if self.step_tokens is not None:
            _positive_int("step_tokens", self.step_tokens)

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one LM token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def within_tokens(self, tokens: int) -> ImageProcessorConfig:
        """These settings for a server whose step computes at most `tokens` tokens: an image that smart resize
        makes larger is resized again to fit (`media.image.target_size`), as OpenAI's API downscales a large
        photo, instead of being refused; every other image is resized exactly as before."""
        return dataclasses.replace(self, step_tokens=tokens)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ImageProcessorConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = _parse(raw, names, "image processor config")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if missing:
            raise MediaConfigError(f"image processor config lacks required settings {missing}")
        try:
            return cls(**kwargs)
        except TypeError as exc:  # wrong value types reach the constructor
            raise MediaConfigError(f"image processor config: {exc}") from exc

    @classmethod
    def from_json_file(cls, path: str | Path) -> ImageProcessorConfig:
        return cls.from_dict(_load_json(path))

    def fingerprint(self) -> str:
        return _fingerprint("image", self)


@dataclass(frozen=True)
class VideoProcessorConfig:
    """Qwen3-VL video preprocessing settings; min/max_pixels bound the TOTAL pixels of the sampled frames."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1.0 / 255.0
    fps: float | None = 2.0
    num_frames: int | None = None  # when set, it wins over fps (as in HF's sample_frames)
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", _triple("image_mean", self.image_mean))
        object.__setattr__(self, "image_std", _triple("image_std", self.image_std))
        _common_checks(self)
        for name in ("min_frames", "max_frames", "max_video_tokens"):
            _positive_int(name, getattr(self, name))
        if self.min_frames > self.max_frames:
            raise MediaConfigError(f"min_frames {self.min_frames} > max_frames {self.max_frames}")
        if self.fps is not None:  # (a request's rates are checked alike: media.rates)
            object.__setattr__(self, "fps", checked_sampling_rate(self.fps, "fps", MediaConfigError))
        if self.num_frames is not None:
            _positive_int("num_frames", self.num_frames)
            if self.num_frames > self.max_frames:  # (HF samples any count; a request's past it is a VideoError)
                raise MediaConfigError(
                    f"num_frames={self.num_frames} is more frames than max_frames={self.max_frames}, the most this "
                    "video processor samples a video to")
        for name in ("do_sample_frames", "cap_pixels_per_frame"):
            if not isinstance(getattr(self, name), bool):
                raise MediaConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> VideoProcessorConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = _parse(raw, names, "video processor config")
        if kwargs.get("cap_pixels_per_frame") is None:
            kwargs.pop("cap_pixels_per_frame", None)  # HF 5.17: None behaves as False
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise MediaConfigError(f"video processor config: {exc}") from exc

    @classmethod
    def from_json_file(cls, path: str | Path) -> VideoProcessorConfig:
        raw = _load_json(path)
        try:
            return cls.from_dict(raw)
        except MediaConfigError as exc:
            raise MediaConfigError(f"{path}: {exc}") from exc

    def fingerprint(self) -> str:
        return _fingerprint("video", self)


def _load_json(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise MediaConfigError(f"cannot read processor config {path}: {exc}") from exc
