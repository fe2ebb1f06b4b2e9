"""Deterministic random-weight Qwen3-VL checkpoints in HF format (`tiny`, `tiny-tied`, `8b`).

Owns: what a generated checkpoint directory contains and that the same (preset, seed) gives
byte-identical files. A checkpoint is config.json (the layout published Qwen3-VL checkpoints use:
`rope_scaling` + `rope_theta`, vision `model_type` "qwen3_vl"), safetensors weights with HF names
(single file, or shards + `model.safetensors.index.json`), tokenizer files, `chat_template.jinja`,
`preprocessor_config.json`, `video_preprocessor_config.json` and `generation_config.json`.
Every tensor is drawn from its own generator seeded by (seed, tensor name), so tensors are produced
one at a time in any order: the 8B build streams to disk without holding the model in memory.
Special-token ids are read from the tokenizer that is written, never from constants.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch
from tokenizers import Tokenizer

from . import tokenizer as tkz
from .safetensors_stream import TensorEntry, write_safetensors

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Preset:
    name: str
    text: dict[str, object]
    vision: dict[str, object]
    tie_word_embeddings: bool
    dtype: str
    tokenizer: str  # "generated" or "qwen" (real Qwen files if installed, else generated + padded vocab)
    vocab_size: int | None  # None: tokenizer size rounded up to a multiple of 64
    shard_max_bytes: int | None
    bpe_vocab_size: int = 960
    image_min_pixels: int = 256 * 256  # Qwen3-VL: 65536 .. 16777216 pixels, factor 32
    image_max_pixels: int = 4096 * 4096
    extra: dict[str, object] = field(default_factory=dict)


_TINY_TEXT: dict[str, object] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "mrope_section": [6, 5, 5],  # sums to head_dim / 2, same t/h/w proportions as the 8B [24, 20, 20]
    "rope_theta": 5_000_000,
    "max_position_embeddings": 262144,
}
_TINY_VISION: dict[str, object] = {
    "depth": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "num_position_embeddings": 144,  # a 12x12 learned grid: every real image is interpolated
    "deepstack_visual_indexes": [0, 1, 2],  # -> added after decoder layers 0, 1, 2 (of 4)
}

PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", _TINY_TEXT, _TINY_VISION, False, "bfloat16", "generated", None, None),
    "tiny-tied": Preset("tiny-tied", _TINY_TEXT, _TINY_VISION, True, "bfloat16", "generated", None, None),
    "8b": Preset(
        "8b",
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "mrope_section": [24, 20, 20],
            "rope_theta": 5_000_000,
            "max_position_embeddings": 262144,
        },
        {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
        },
        False,
        "bfloat16",
        "qwen",
        151936,
        5 * 1024**3,
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown checkpoint preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


# ----------------------------------------------------------------------------------------- config
def _token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {}
    for content, _ in tkz.QWEN_ADDED_TOKENS:
        tid = tok.token_to_id(content)
        if tid is None:
            raise ValueError(f"tokenizer lacks {content!r}")
        ids[content] = tid
    return ids


def hf_config_dict(preset: Preset, tok: Tokenizer) -> dict:
    """The config.json the builder writes for `preset`, token ids read from `tok`."""
    ids = _token_ids(tok)
    vocab = preset.vocab_size
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    if vocab is None:
        vocab = -(-n_tok // 64) * 64
    if vocab < n_tok:
        raise ValueError(f"vocab_size {vocab} < tokenizer size {n_tok}")
    t = preset.text
    section = list(t["mrope_section"])  # type: ignore[arg-type]
    if sum(section) * 2 != t["head_dim"]:
        raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {t['head_dim']}/2")
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[tkz.ENDOFTEXT],
        "dtype": preset.dtype,
        "eos_token_id": ids[tkz.IM_END],
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": t["intermediate_size"],
        "max_position_embeddings": t["max_position_embeddings"],
        "model_type": "qwen3_vl_text",
        "num_attention_heads": t["num_attention_heads"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": section, "rope_type": "default"},
        "rope_theta": t["rope_theta"],
        "use_cache": True,
        "vocab_size": vocab,
    }
    v = preset.vision
    vision_config = {
        "deepstack_visual_indexes": list(v["deepstack_visual_indexes"]),  # type: ignore[call-overload]
        "depth": v["depth"],
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": v["hidden_size"],
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": v["intermediate_size"],
        "model_type": "qwen3_vl",
        "num_heads": v["num_heads"],
        "num_position_embeddings": v["num_position_embeddings"],
        "out_hidden_size": t["hidden_size"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "dtype": preset.dtype,
        "image_token_id": ids[tkz.IMAGE_PAD],
        "model_type": "qwen3_vl",
        "text_config": text_config,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "video_token_id": ids[tkz.VIDEO_PAD],
        "vision_config": vision_config,
        "vision_end_token_id": ids[tkz.VISION_END],
        "vision_start_token_id": ids[tkz.VISION_START],
    }


def _preprocessor_configs(preset: Preset) -> tuple[dict, dict]:
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": 2,
        "patch_size": 16,
        "processor_class": "Qwen3VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "temporal_patch_size": 2,
    }
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"longest_edge": preset.image_max_pixels, "shortest_edge": preset.image_min_pixels},
    }
    video = {
        **common,
        "do_sample_frames": True,
        "fps": 2,
        "max_frames": 768,
        "min_frames": 4,
        "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    return image, video


def _generation_config(tok: Tokenizer) -> dict:
    ids = _token_ids(tok)
    return {
        "bos_token_id": ids[tkz.ENDOFTEXT],
        "do_sample": True,
        "eos_token_id": [ids[tkz.IM_END], ids[tkz.ENDOFTEXT]],
        "pad_token_id": ids[tkz.ENDOFTEXT],
        "repetition_penalty": 1.0,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }


# ---------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class _Init:
    kind: str  # "normal" (std) | "ones" (1 + std * N) ; biases are "normal" with a small std
    std: float


def hf_weight_entries(config: dict, dtype: torch.dtype) -> list[tuple[TensorEntry, _Init]]:
    """Every tensor of the HF `Qwen3VLForConditionalGeneration` state dict, in model order."""
    out: list[tuple[TensorEntry, _Init]] = []

    def lin(name: str, rows: int, cols: int, bias: bool) -> None:
        out.append((TensorEntry(f"{name}.weight", (rows, cols), dtype), _Init("normal", cols**-0.5)))
        if bias:
            out.append((TensorEntry(f"{name}.bias", (rows,), dtype), _Init("normal", 0.02)))

    def norm(name: str, dim: int, bias: bool) -> None:
        out.append((TensorEntry(f"{name}.weight", (dim,), dtype), _Init("ones", 0.1)))
        if bias:
            out.append((TensorEntry(f"{name}.bias", (dim,), dtype), _Init("normal", 0.02)))

    v, t = config["vision_config"], config["text_config"]
    e, c, tp, p = v["hidden_size"], v["in_channels"], v["temporal_patch_size"], v["patch_size"]
    vp = "model.visual"
    fan_in = c * tp * p * p
    out.append(
        (TensorEntry(f"{vp}.patch_embed.proj.weight", (e, c, tp, p, p), dtype), _Init("normal", fan_in**-0.5))
    )
    out.append((TensorEntry(f"{vp}.patch_embed.proj.bias", (e,), dtype), _Init("normal", 0.02)))
    out.append(
        (
            TensorEntry(f"{vp}.pos_embed.weight", (v["num_position_embeddings"], e), dtype),
            _Init("normal", 0.5),
        )
    )
    for i in range(v["depth"]):
        b = f"{vp}.blocks.{i}"
        norm(f"{b}.norm1", e, True)
        norm(f"{b}.norm2", e, True)
        lin(f"{b}.attn.qkv", 3 * e, e, True)
        lin(f"{b}.attn.proj", e, e, True)
        lin(f"{b}.mlp.linear_fc1", v["intermediate_size"], e, True)
        lin(f"{b}.mlp.linear_fc2", e, v["intermediate_size"], True)
    merged = e * v["spatial_merge_size"] ** 2
    for m, norm_dim in [("merger", e)] + [
        (f"deepstack_merger_list.{j}", merged) for j in range(len(v["deepstack_visual_indexes"]))
    ]:
        norm(f"{vp}.{m}.norm", norm_dim, True)
        lin(f"{vp}.{m}.linear_fc1", merged, merged, True)
        lin(f"{vp}.{m}.linear_fc2", v["out_hidden_size"], merged, True)

    h, d, voc = t["hidden_size"], t["head_dim"], t["vocab_size"]
    lp = "model.language_model"
    out.append((TensorEntry(f"{lp}.embed_tokens.weight", (voc, h), dtype), _Init("normal", 1.0)))
    for i in range(t["num_hidden_layers"]):
        b = f"{lp}.layers.{i}"
        norm(f"{b}.input_layernorm", h, False)
        lin(f"{b}.self_attn.q_proj", t["num_attention_heads"] * d, h, False)
        lin(f"{b}.self_attn.k_proj", t["num_key_value_heads"] * d, h, False)
        lin(f"{b}.self_attn.v_proj", t["num_key_value_heads"] * d, h, False)
        lin(f"{b}.self_attn.o_proj", h, t["num_attention_heads"] * d, False)
        norm(f"{b}.self_attn.q_norm", d, False)
        norm(f"{b}.self_attn.k_norm", d, False)
        norm(f"{b}.post_attention_layernorm", h, False)
        lin(f"{b}.mlp.gate_proj", t["intermediate_size"], h, False)
        lin(f"{b}.mlp.up_proj", t["intermediate_size"], h, False)
        lin(f"{b}.mlp.down_proj", h, t["intermediate_size"], False)
    norm(f"{lp}.norm", h, False)
    if not config["tie_word_embeddings"]:
        lin("lm_head", voc, h, False)
    return out


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"prism-checkpoint:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _producer(
    seed: int, inits: dict[str, _Init], device: torch.device
) -> Callable[[TensorEntry], torch.Tensor]:
    def produce(entry: TensorEntry) -> torch.Tensor:
        init = inits[entry.name]
        gen = torch.Generator(device=device)
        gen.manual_seed(_tensor_seed(seed, entry.name))
        x = torch.randn(entry.shape, generator=gen, device=device, dtype=torch.float32)
        x.mul_(init.std)
        if init.kind == "ones":
            x.add_(1.0)
        return x.to(entry.dtype)

    return produce


def _shard(entries: list[TensorEntry], max_bytes: int | None) -> list[list[TensorEntry]]:
    if max_bytes is None:
        return [entries]
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


# ---------------------------------------------------------------------------------------- builder
def _write_tokenizer(preset: Preset, out: Path) -> Tokenizer:
    max_len = int(preset.text["max_position_embeddings"])  # type: ignore[arg-type]
    if preset.tokenizer == "qwen":
        src = tkz.find_qwen_tokenizer_files()
        if src is not None:
            return tkz.write_qwen_tokenizer(out, src, max_len)
    return tkz.write_generated_tokenizer(out, preset.bpe_vocab_size, max_len)


def checkpoint_config(preset: str) -> dict:
    """The config.json dict `build_checkpoint(preset, ...)` would write (builds no weights)."""
    p = get_preset(preset)
    with tempfile.TemporaryDirectory() as tmp:
        tok = _write_tokenizer(p, Path(tmp))
    return hf_config_dict(p, tok)


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_checkpoint(
    preset: str,
    out_dir: str | os.PathLike[str],
    seed: int = 0,
    *,
    shard_max_bytes: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> Path:
    """Build a random-weight HF Qwen3-VL checkpoint of `preset` into `out_dir` (absent or empty).

    `shard_max_bytes` overrides the preset's sharding (None keeps it; tiny presets are one file).
    `device` is where the random tensors are drawn ("cuda" for the 8B build); the bytes depend on
    (preset, seed, device kind), never on build order or timing.
    """
    p = get_preset(preset)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"checkpoint output directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)

    tok = _write_tokenizer(p, out)
    config = hf_config_dict(p, tok)
    _dump(out / "config.json", config)
    image_cfg, video_cfg = _preprocessor_configs(p)
    _dump(out / "preprocessor_config.json", image_cfg)
    _dump(out / "video_preprocessor_config.json", video_cfg)
    _dump(out / "generation_config.json", _generation_config(tok))

    specs = hf_weight_entries(config, _DTYPES[p.dtype])
    entries = [e for e, _ in specs]
    produce = _producer(seed, {e.name: i for e, i in specs}, dev)
    if progress:
        produce = _with_progress(produce, entries)
    shards = _shard(entries, shard_max_bytes if shard_max_bytes is not None else p.shard_max_bytes)
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0], produce)
        return out
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / fname, shard, produce)
        weight_map.update({e.name: fname for e in shard})
    _dump(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return out


def _with_progress(produce: Callable[[TensorEntry], torch.Tensor], entries: list[TensorEntry]):
    from tqdm import tqdm

    bar = tqdm(total=sum(e.nbytes for e in entries), unit="B", unit_scale=True, desc="building checkpoint")

    def wrapped(entry: TensorEntry) -> torch.Tensor:
        t = produce(entry)
        bar.update(entry.nbytes)
        return t

    return wrapped


def _builder_fingerprint() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in ("checkpoints.py", "tokenizer.py", "safetensors_stream.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def default_cache_dir() -> Path:
    env = os.environ.get("PRISM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prism"


def ensure_checkpoint(preset: str, cache_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """Build `preset` once into the cache (keyed by preset, seed and builder source) and reuse it.

    Concurrent callers each build into a private temp dir and `rename` it into place; the loser of
    the race discards its copy, so a reader never sees a half-written checkpoint.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = root / "checkpoints"
    target = root / f"{preset}-seed{seed}-{_builder_fingerprint()}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        build_checkpoint(preset, tmp, seed=seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The shared tiny checkpoint (CPU tests, the server's embedded default)."""
    return ensure_checkpoint("tiny", cache_dir)


def checkpoint_num_params(config: dict) -> int:
    return sum(prod(e.shape) for e, _ in hf_weight_entries(config, torch.bfloat16))
