"""Typed Qwen3-VL model configuration, read from an HF `config.json`.

Owns: which config keys Prism understands. Both the published layout (`rope_scaling` + `rope_theta`,
vision `model_type` "qwen3_vl") and the layout transformers 5.x writes (`rope_parameters`) are read.
A missing required key, a key we do not know, or a value we do not implement raises `ConfigError`
naming the key: silently ignoring a setting would silently compute another model. Keys that carry
no inference semantics (HF bookkeeping, training-only settings) are listed explicitly as ignored.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """config.json is missing a key, has an unknown key, or asks for something we do not implement."""


# Keys that exist in published or HF-written configs but do not change inference.
_IGNORED_COMMON = frozenset(
    {
        "_name_or_path",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "initializer_range",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_dropout",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
    }
)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    mrope_section: tuple[int, int, int]
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = 128000


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)


@dataclass(frozen=True)
class Qwen3VLConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    tie_word_embeddings: bool = False
    dtype: str | None = None  # the checkpoint's storage dtype, informational

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen3VLConfig:
        return _parse_top(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Qwen3VLConfig:
        p = Path(path)
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"no config file at {p}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{p} must hold a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> Qwen3VLConfig:
        return cls.from_file(Path(model_dir) / "config.json")


class _Reader:
    """Takes keys out of one config section; `finish` rejects whatever is left."""

    def __init__(self, d: Any, section: str, ignored: frozenset[str]):
        if not isinstance(d, dict):
            raise ConfigError(f"{section} must be a JSON object, got {type(d).__name__}")
        self.d = dict(d)
        self.section = section
        self.ignored = ignored

    def _path(self, key: str) -> str:
        return f"{self.section}.{key}" if self.section != "config" else key

    def req(self, key: str, typ: type) -> Any:
        if key not in self.d:
            raise ConfigError(f"config.json: required key {self._path(key)!r} is missing")
        return self._check(key, self.d.pop(key), typ)

    def opt(self, key: str, typ: type, default: Any) -> Any:
        if key not in self.d or self.d[key] is None:
            self.d.pop(key, None)
            return default
        return self._check(key, self.d.pop(key), typ)

    def pop(self, key: str) -> Any:
        return self.d.pop(key, None)

    def _check(self, key: str, value: Any, typ: type) -> Any:
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if (typ is int and isinstance(value, bool)) or not isinstance(value, typ):
            raise ConfigError(f"config.json: {self._path(key)} must be {typ.__name__}, got {value!r}")
        return value

    def finish(self) -> None:
        unknown = sorted(k for k in self.d if k not in self.ignored)
        if unknown:
            raise ConfigError(f"config.json: unknown key(s) in {self.section}: {unknown}")


def _int_list(r: _Reader, key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise ConfigError(f"config.json: {r._path(key)} must be a list of ints, got {value!r}")
    return tuple(value)


def _parse_rope(r: _Reader, head_dim: int) -> tuple[float, tuple[int, int, int]]:
    params = r.pop("rope_parameters")
    scaling = r.pop("rope_scaling")
    theta = r.pop("rope_theta")
    rope = params if params is not None else scaling
    if rope is None:
        raise ConfigError(
            "config.json: text_config needs 'rope_parameters' or 'rope_scaling' (with mrope_section)"
        )
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json: text_config rope settings must be an object, got {rope!r}")
    rope = dict(rope)
    theta = rope.pop("rope_theta", theta)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config.json: text_config rope_theta must be a positive number, got {theta!r}")
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"config.json: text_config rope_type {rope_type!r} is not supported (only 'default')"
        )
    if rope.pop("mrope_interleaved", True) is not True:
        raise ConfigError("config.json: text_config mrope_interleaved=false is not Qwen3-VL's M-RoPE")
    if "mrope_section" not in rope:
        raise ConfigError("config.json: required key 'text_config.rope_scaling.mrope_section' is missing")
    section = _int_list(r, "mrope_section", rope.pop("mrope_section"))
    if len(section) != 3 or sum(section) * 2 != head_dim or min(section) < 0:
        raise ConfigError(
            f"config.json: mrope_section {list(section)} must be 3 sizes summing to head_dim/2={head_dim // 2}"
        )
    if rope:
        raise ConfigError(f"config.json: unknown key(s) in text_config rope settings: {sorted(rope)}")
    return float(theta), (section[0], section[1], section[2])


def _parse_text(d: Any) -> tuple[TextConfig, bool | None]:
    r = _Reader(d, "text_config", _IGNORED_COMMON)
    model_type = r.pop("model_type")
    if model_type not in (None, "qwen3_vl_text"):
        raise ConfigError(f"config.json: text_config.model_type {model_type!r} is not 'qwen3_vl_text'")
    tie = r.opt("tie_word_embeddings", bool, None)
    heads = r.req("num_attention_heads", int)
    head_dim = r.req("head_dim", int)
    kv = r.opt("num_key_value_heads", int, heads)
    theta, section = _parse_rope(r, head_dim)
    cfg = TextConfig(
        vocab_size=r.req("vocab_size", int),
        hidden_size=r.req("hidden_size", int),
        intermediate_size=r.req("intermediate_size", int),
        num_hidden_layers=r.req("num_hidden_layers", int),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rope_theta=theta,
        mrope_section=section,
        rms_norm_eps=r.opt("rms_norm_eps", float, 1e-6),
        hidden_act=r.opt("hidden_act", str, "silu"),
        attention_bias=r.opt("attention_bias", bool, False),
        max_position_embeddings=r.opt("max_position_embeddings", int, 128000),
    )
    r.finish()
    if cfg.hidden_act != "silu":
        raise ConfigError(
            f"config.json: text_config.hidden_act {cfg.hidden_act!r} is not supported (only 'silu')"
        )
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
    ):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"config.json: text_config.{key} must be positive")
    if kv <= 0 or heads % kv:
        raise ConfigError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    if head_dim % 2:
        raise ConfigError(f"config.json: text_config.head_dim {head_dim} must be even")
    return cfg, tie


_VISION_ACTS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


def _parse_vision(d: Any) -> VisionConfig:
    r = _Reader(d, "vision_config", _IGNORED_COMMON)
    model_type = r.pop("model_type")
    if model_type not in (None, "qwen3_vl", "qwen3_vl_vision"):
        raise ConfigError(
            f"config.json: vision_config.model_type {model_type!r} is not a Qwen3-VL vision model"
        )
    rope = r.pop("rope_parameters")
    theta = 10000.0
    if rope is not None:
        if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"config.json: vision_config.rope_parameters {rope!r} is not axial rope")
        theta = float(rope.get("rope_theta", theta))
        if set(rope) - {"rope_type", "rope_theta"}:
            raise ConfigError(
                f"config.json: unknown key(s) in vision_config.rope_parameters: {sorted(set(rope) - {'rope_type', 'rope_theta'})}"
            )
    cfg = VisionConfig(
        depth=r.req("depth", int),
        hidden_size=r.req("hidden_size", int),
        intermediate_size=r.req("intermediate_size", int),
        num_heads=r.req("num_heads", int),
        out_hidden_size=r.req("out_hidden_size", int),
        num_position_embeddings=r.req("num_position_embeddings", int),
        deepstack_visual_indexes=_int_list(
            r, "deepstack_visual_indexes", r.req("deepstack_visual_indexes", list)
        ),
        patch_size=r.req("patch_size", int),
        temporal_patch_size=r.req("temporal_patch_size", int),
        spatial_merge_size=r.req("spatial_merge_size", int),
        in_channels=r.opt("in_channels", int, 3),
        hidden_act=r.opt("hidden_act", str, "gelu_pytorch_tanh"),
        rope_theta=theta,
    )
    r.finish()
    if cfg.hidden_act not in _VISION_ACTS:
        raise ConfigError(f"config.json: vision_config.hidden_act {cfg.hidden_act!r} not in {_VISION_ACTS}")
    if cfg.num_heads <= 0 or cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        raise ConfigError(
            f"config.json: vision hidden_size {cfg.hidden_size} / num_heads {cfg.num_heads} must give a head_dim divisible by 4"
        )
    if cfg.num_grid_per_side**2 != cfg.num_position_embeddings:
        raise ConfigError(
            f"config.json: vision num_position_embeddings {cfg.num_position_embeddings} is not a square"
        )
    idx = cfg.deepstack_visual_indexes
    if len(set(idx)) != len(idx) or any(not 0 <= i < cfg.depth for i in idx):
        raise ConfigError(
            f"config.json: deepstack_visual_indexes {list(idx)} must be distinct blocks in [0, {cfg.depth})"
        )
    return cfg


def _parse_top(d: dict[str, Any]) -> Qwen3VLConfig:
    r = _Reader(d, "config", _IGNORED_COMMON)
    model_type = r.pop("model_type")
    if model_type not in (None, "qwen3_vl"):
        raise ConfigError(f"config.json: model_type {model_type!r} is not 'qwen3_vl'")
    text, text_tie = _parse_text(r.req("text_config", dict))
    vision = _parse_vision(r.req("vision_config", dict))
    dtype = d.get("dtype") or d.get("torch_dtype")
    tie = r.opt("tie_word_embeddings", bool, text_tie if text_tie is not None else False)
    cfg = Qwen3VLConfig(
        text=text,
        vision=vision,
        image_token_id=r.req("image_token_id", int),
        video_token_id=r.req("video_token_id", int),
        vision_start_token_id=r.req("vision_start_token_id", int),
        vision_end_token_id=r.req("vision_end_token_id", int),
        tie_word_embeddings=tie,
        dtype=dtype if isinstance(dtype, str) else None,
    )
    r.finish()
    ids = {
        "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
    }
    for name, tid in ids.items():
        if not 0 <= tid < text.vocab_size:
            raise ConfigError(f"config.json: {name} {tid} is outside the vocabulary [0, {text.vocab_size})")
    if len(set(ids.values())) != len(ids):
        raise ConfigError(f"config.json: special token ids must be distinct, got {ids}")
    if vision.out_hidden_size != text.hidden_size:
        raise ConfigError(
            f"config.json: vision out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}"
        )
    if len(vision.deepstack_visual_indexes) > text.num_hidden_layers:
        raise ConfigError("config.json: more DeepStack features than decoder layers to add them to")
    return cfg
