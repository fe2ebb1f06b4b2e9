"""The HTTP server's settings: one frozen dataclass read from PRISM_* environment variables.

Owns the server-side limits that turn hostile input into a 4xx instead of memory or time spent: media size, count
and pixels, request body size and the time its arrival may take, the admission queue bound, and which media sources
exist at all (local files only under one root; remote URLs only when switched on). A bad value fails at start-up with a
`ValueError` that names the environment variable, never later inside a request.

| field                      | variable                         | default                                |
|----------------------------|----------------------------------|----------------------------------------|
| model_dir                  | PRISM_MODEL                      | None (the embedded tiny checkpoint)    |
| engine_config_path         | PRISM_CONFIG                     | None                                   |
| served_model_name          | PRISM_SERVED_MODEL_NAME          | model dir's name, or "prism-tiny"      |
| media_root                 | PRISM_MEDIA_ROOT                 | None (local files refused)             |
| allow_remote_media         | PRISM_ALLOW_REMOTE_MEDIA         | False                                  |
| remote_media_timeout_s     | PRISM_REMOTE_MEDIA_TIMEOUT_S     | 10.0                                   |
| remote_media_max_redirects | PRISM_REMOTE_MEDIA_MAX_REDIRECTS | 3                                      |
| max_media_bytes            | PRISM_MAX_MEDIA_BYTES            | 20 MiB per item (encoded bytes)        |
| max_media_per_request      | PRISM_MAX_MEDIA_PER_REQUEST      | 16 (images + videos)                   |
| max_video_frames           | PRISM_MAX_VIDEO_FRAMES           | 256 frames per video                   |
| max_video_pixels           | PRISM_MAX_VIDEO_PIXELS           | 2**27 sampled frame pixels per request |
| max_image_pixels           | PRISM_MAX_IMAGE_PIXELS           | 2**28 image pixels per request         |
| max_request_bytes          | PRISM_MAX_REQUEST_BYTES          | 64 MiB (HTTP body; also all media)     |
| body_read_timeout_s        | PRISM_BODY_READ_TIMEOUT_S        | 30.0 (+1 s per 128 KiB of body read)   |
| header_read_timeout_s      | PRISM_HEADER_READ_TIMEOUT_S      | 10.0 (needs header_deadline's protocol) |
| max_waiting_requests       | PRISM_MAX_WAITING                | 256 (more -> 429)                      |
| preprocess_workers         | PRISM_PREPROCESS_WORKERS         | 4                                      |
| data_url_cache_bytes       | PRISM_DATA_URL_CACHE_BYTES       | 256 MiB of recent data URLs (0: none)  |
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..media.pixel_budget import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_VIDEO_PIXELS

EMBEDDED_MODEL_NAME = "prism-tiny"
MIB = 1024 * 1024

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class ServerSettings:
    """Validated server settings; construct directly (tests) or with `from_env()`."""

    model_dir: Path | None = None
    engine_config_path: Path | None = None
    served_model_name: str | None = None  # None -> derived from model_dir in __post_init__
    media_root: Path | None = None  # stored resolved (symlinks followed), so containment checks are exact
    allow_remote_media: bool = False
    remote_media_timeout_s: float = 10.0
    remote_media_max_redirects: int = 3
    max_media_bytes: int = 20 * MIB
    max_media_per_request: int = 16
    max_video_frames: int = 256
    # The frames a request's videos sample in all (media.pixel_budget); also the budget of the engine the server
    # builds, unless PRISM_CONFIG's file names its own (then the lower applies: server_state.engine_config_of).
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS
    # The pixels a request's images may announce in all (their headers, before any is decoded; media.pixel_budget):
    # 16 images at 4096 x 4096. Also the engine's budget, as max_video_pixels is.
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_request_bytes: int = 64 * MIB
    body_read_timeout_s: float = 30.0  # the body in that time (+1 s per 128 KiB read), or a 408 (body_deadline.py)
    # A request head (line and headers) whole in that time, or the connection closed (header_deadline.py): set on
    # uvicorn's protocol, which `prism serve` runs and `uvicorn src.prism.server:app` does not.
    header_read_timeout_s: float = 10.0
    max_waiting_requests: int = 256
    preprocess_workers: int = 4
    data_url_cache_bytes: int = 256 * MIB  # decoded payloads of repeated data URLs (serving/data_url_cache.py)

    def __post_init__(self) -> None:
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.engine_config_path is not None:
            object.__setattr__(self, "engine_config_path", Path(self.engine_config_path))
        name = self.served_model_name
        if name is None:
            name = self.model_dir.name if self.model_dir is not None else EMBEDDED_MODEL_NAME
            name = name or EMBEDDED_MODEL_NAME  # Path("/").name is ""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"served_model_name must be a non-empty string, got {name!r}")
        object.__setattr__(self, "served_model_name", name)
        if self.media_root is not None:
            try:
                root = Path(self.media_root).resolve(strict=True)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ValueError(f"media_root {self.media_root!s} does not exist: {exc}") from exc
            if not root.is_dir():
                raise ValueError(f"media_root {root} is not a directory")
            object.__setattr__(self, "media_root", root)
        if not isinstance(self.allow_remote_media, bool):
            raise ValueError(f"allow_remote_media must be a bool, got {self.allow_remote_media!r}")
        for field_name in ("remote_media_timeout_s", "body_read_timeout_s", "header_read_timeout_s"):
            t = getattr(self, field_name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
                raise ValueError(f"{field_name} must be a finite number > 0, got {t!r}")
            object.__setattr__(self, field_name, float(t))
        if not _is_int(self.data_url_cache_bytes) or self.data_url_cache_bytes < 0:
            raise ValueError(f"data_url_cache_bytes must be an integer >= 0, got {self.data_url_cache_bytes!r}")
        if not _is_int(self.remote_media_max_redirects) or self.remote_media_max_redirects < 0:
            raise ValueError(
                f"remote_media_max_redirects must be an integer >= 0, got {self.remote_media_max_redirects!r}"
            )
        for field_name in (
            "max_media_bytes",
            "max_media_per_request",
            "max_video_frames",
            "max_video_pixels",
            "max_image_pixels",
            "max_request_bytes",
            "max_waiting_requests",
            "preprocess_workers",
        ):
            value = getattr(self, field_name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{field_name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerSettings:
        """Settings from PRISM_* variables (`env` defaults to os.environ); unset or empty means the default."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}

        def get(var: str) -> str | None:
            value = env.get(var)
            return None if value is None or not value.strip() else value.strip()

        if (model := get("PRISM_MODEL")) is not None:
            if not Path(model).is_dir():
                raise ValueError(f"PRISM_MODEL={model!r} is not a directory")
            kwargs["model_dir"] = Path(model)
        if (config := get("PRISM_CONFIG")) is not None:
            if not Path(config).is_file():
                raise ValueError(f"PRISM_CONFIG={config!r} is not a file")
            kwargs["engine_config_path"] = Path(config)
        if (name := get("PRISM_SERVED_MODEL_NAME")) is not None:
            kwargs["served_model_name"] = name
        if (root := get("PRISM_MEDIA_ROOT")) is not None:
            if not os.path.isabs(root):
                raise ValueError(f"PRISM_MEDIA_ROOT={root!r} must be an absolute path")
            if not Path(root).is_dir():
                raise ValueError(f"PRISM_MEDIA_ROOT={root!r} is not an existing directory")
            kwargs["media_root"] = Path(root)
        if (flag := env.get("PRISM_ALLOW_REMOTE_MEDIA")) is not None:
            kwargs["allow_remote_media"] = _parse_bool("PRISM_ALLOW_REMOTE_MEDIA", flag)
        for var, field_name in (("PRISM_REMOTE_MEDIA_TIMEOUT_S", "remote_media_timeout_s"),
                                ("PRISM_BODY_READ_TIMEOUT_S", "body_read_timeout_s"),
                                ("PRISM_HEADER_READ_TIMEOUT_S", "header_read_timeout_s")):
            if (timeout := get(var)) is not None:
                kwargs[field_name] = _parse_positive_float(var, timeout)
        for var, field_name, minimum in (
            ("PRISM_REMOTE_MEDIA_MAX_REDIRECTS", "remote_media_max_redirects", 0),
            ("PRISM_MAX_MEDIA_BYTES", "max_media_bytes", 1),
            ("PRISM_MAX_MEDIA_PER_REQUEST", "max_media_per_request", 1),
            ("PRISM_MAX_VIDEO_FRAMES", "max_video_frames", 1),
            ("PRISM_MAX_VIDEO_PIXELS", "max_video_pixels", 1),
            ("PRISM_MAX_IMAGE_PIXELS", "max_image_pixels", 1),
            ("PRISM_MAX_REQUEST_BYTES", "max_request_bytes", 1),
            ("PRISM_MAX_WAITING", "max_waiting_requests", 1),
            ("PRISM_PREPROCESS_WORKERS", "preprocess_workers", 1),
            ("PRISM_DATA_URL_CACHE_BYTES", "data_url_cache_bytes", 0),
        ):
            if (raw := get(var)) is not None:
                kwargs[field_name] = _parse_int(var, raw, minimum)
        return cls(**kwargs)  # type: ignore[arg-type]


def _parse_bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r} must be one of 1/0, true/false, yes/no, on/off")


def _parse_int(var: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        raise ValueError(f"{var}={raw!r} must be a decimal integer >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"{var}={raw!r} must be >= {minimum}")
    return value


def _parse_positive_float(var: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} must be a number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{var}={raw!r} must be a finite number > 0")
    return value
