"""Load an HF Qwen3-VL checkpoint directory into `Qwen3VLModel`.

Owns: the map from HF tensor names to Prism parameters (`hf_weight_plan`) and the checks that a
checkpoint is exactly the model its config describes. Every tensor header is validated before any
data is read: a missing, unexpected, duplicated or mis-shaped tensor raises a `CheckpointError`
subclass naming it. Weights are streamed file by file into parameters allocated once on the target
device (no second copy of the model), converted to the requested dtype on the way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .config import Qwen3VLConfig
from .qwen3_vl import Qwen3VLModel

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SOURCE_DTYPES = {"BF16", "F16", "F32"}
_PROGRESS_MIN_BYTES = 1 << 30


class CheckpointError(ValueError):
    """The checkpoint directory does not hold exactly the tensors its config.json describes."""


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class TensorShapeError(CheckpointError):
    pass


@dataclass(frozen=True)
class TensorSlot:
    """Where one HF tensor goes: rows [row_start, row_start + shape[0]) of Prism parameter `param`."""

    param: str
    row_start: int
    shape: tuple[int, ...]


def hf_weight_plan(config: Qwen3VLConfig) -> dict[str, TensorSlot]:
    """HF tensor name -> slot, for every tensor a checkpoint of `config` must contain."""
    v, t = config.vision, config.text
    plan: dict[str, TensorSlot] = {}

    def put(hf: str, param: str, shape: tuple[int, ...], row_start: int = 0) -> None:
        plan[hf] = TensorSlot(param, row_start, shape)

    def linear(hf: str, param: str, rows: int, cols: int, bias: bool, row_start: int = 0) -> None:
        put(f"{hf}.weight", f"{param}.weight", (rows, cols), row_start)
        if bias:
            put(f"{hf}.bias", f"{param}.bias", (rows,), row_start)

    def norm(hf: str, param: str, dim: int, bias: bool) -> None:
        put(f"{hf}.weight", f"{param}.weight", (dim,))
        if bias:
            put(f"{hf}.bias", f"{param}.bias", (dim,))

    e = v.hidden_size
    put(
        "model.visual.patch_embed.proj.weight",
        "visual.patch_embed.weight",
        (e, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
    )
    put("model.visual.patch_embed.proj.bias", "visual.patch_embed.bias", (e,))
    put("model.visual.pos_embed.weight", "visual.pos_embed.weight", (v.num_position_embeddings, e))
    for i in range(v.depth):
        hf, ours = f"model.visual.blocks.{i}", f"visual.blocks.{i}"
        norm(f"{hf}.norm1", f"{ours}.norm1", e, True)
        norm(f"{hf}.norm2", f"{ours}.norm2", e, True)
        linear(f"{hf}.attn.qkv", f"{ours}.qkv", 3 * e, e, True)
        linear(f"{hf}.attn.proj", f"{ours}.proj", e, e, True)
        linear(f"{hf}.mlp.linear_fc1", f"{ours}.fc1", v.intermediate_size, e, True)
        linear(f"{hf}.mlp.linear_fc2", f"{ours}.fc2", e, v.intermediate_size, True)
    mergers = [("model.visual.merger", "visual.merger", e)] + [
        (f"model.visual.deepstack_merger_list.{j}", f"visual.deepstack_mergers.{j}", v.merged_dim)
        for j in range(len(v.deepstack_visual_indexes))
    ]
    for hf, ours, norm_dim in mergers:
        norm(f"{hf}.norm", f"{ours}.norm", norm_dim, True)
        linear(f"{hf}.linear_fc1", f"{ours}.fc1", v.merged_dim, v.merged_dim, True)
        linear(f"{hf}.linear_fc2", f"{ours}.fc2", v.out_hidden_size, v.merged_dim, True)

    h, d = t.hidden_size, t.head_dim
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    put("model.language_model.embed_tokens.weight", "language_model.embed_tokens.weight", (t.vocab_size, h))
    for i in range(t.num_hidden_layers):
        hf, ours = f"model.language_model.layers.{i}", f"language_model.layers.{i}"
        norm(f"{hf}.input_layernorm", f"{ours}.input_layernorm", h, False)
        norm(f"{hf}.post_attention_layernorm", f"{ours}.post_attention_layernorm", h, False)
        linear(f"{hf}.self_attn.q_proj", f"{ours}.self_attn.qkv", q, h, t.attention_bias, 0)
        linear(f"{hf}.self_attn.k_proj", f"{ours}.self_attn.qkv", kv, h, t.attention_bias, q)
        linear(f"{hf}.self_attn.v_proj", f"{ours}.self_attn.qkv", kv, h, t.attention_bias, q + kv)
        linear(f"{hf}.self_attn.o_proj", f"{ours}.self_attn.o_proj", h, q, t.attention_bias)
        norm(f"{hf}.self_attn.q_norm", f"{ours}.self_attn.q_norm", d, False)
        norm(f"{hf}.self_attn.k_norm", f"{ours}.self_attn.k_norm", d, False)
        linear(f"{hf}.mlp.gate_proj", f"{ours}.mlp.gate_up", t.intermediate_size, h, False, 0)
        linear(f"{hf}.mlp.up_proj", f"{ours}.mlp.gate_up", t.intermediate_size, h, False, t.intermediate_size)
        linear(f"{hf}.mlp.down_proj", f"{ours}.mlp.down_proj", h, t.intermediate_size, False)
    put("model.language_model.norm.weight", "language_model.norm.weight", (h,))
    if not config.tie_word_embeddings:
        put("lm_head.weight", "lm_head.weight", (t.vocab_size, h))
    return plan


def checkpoint_files(model_dir: str | os.PathLike[str]) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, if sharded, its index weight map."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index with a 'weight_map': {e}") from e
        files = []
        for name in sorted(set(weight_map.values())):
            path = root / name
            if not path.is_file():
                raise CheckpointError(f"{index} lists shard {name!r}, which is missing from {root}")
            files.append(path)
        return files, weight_map
    single = root / "model.safetensors"
    if single.is_file():
        return [single], None
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {root}")


@dataclass(frozen=True)
class _Header:
    name: str
    file: Path
    shape: tuple[int, ...]
    nbytes: int


def _read_headers(files: Iterable[Path], weight_map: dict[str, str] | None) -> dict[str, _Header]:
    headers: dict[str, _Header] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in headers:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {headers[name].file.name} and {path.name}"
                    )
                if weight_map is not None and weight_map.get(name) != path.name:
                    raise CheckpointError(
                        f"tensor {name!r} is in {path.name} but the index maps it to {weight_map.get(name)!r}"
                    )
                sl = f.get_slice(name)
                dtype = sl.get_dtype()
                if dtype not in _SOURCE_DTYPES:
                    raise CheckpointError(
                        f"tensor {name!r} has dtype {dtype}; only BF16/F16/F32 checkpoints load"
                    )
                shape = tuple(int(x) for x in sl.get_shape())
                size = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
                n = 1
                for x in shape:
                    n *= x
                headers[name] = _Header(name, path, shape, n * size)
    if weight_map is not None:
        listed_missing = sorted(set(weight_map) - set(headers))
        if listed_missing:
            raise MissingTensorError(
                f"tensors listed in the index but absent from their shard: {listed_missing[:8]}"
            )
    return headers


def _validate(plan: dict[str, TensorSlot], headers: dict[str, _Header], tied: bool) -> list[str]:
    """Return the tensor names to load; raise on any mismatch."""
    ignorable = {"lm_head.weight"} if tied else set()
    unexpected = sorted(n for n in headers if n not in plan and n not in ignorable)
    if unexpected:
        raise UnexpectedTensorError(
            f"{len(unexpected)} tensor(s) in the checkpoint that the config does not describe: {unexpected[:8]}"
        )
    missing = sorted(n for n in plan if n not in headers)
    if missing:
        raise MissingTensorError(f"{len(missing)} tensor(s) missing from the checkpoint: {missing[:8]}")
    for name, slot in plan.items():
        if headers[name].shape != slot.shape:
            raise TensorShapeError(
                f"tensor {name!r} has shape {list(headers[name].shape)}, the config implies {list(slot.shape)}"
            )
    return [n for n in headers if n in plan]


def load_model(
    model_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
) -> Qwen3VLModel:
    """Build `Qwen3VLModel` from an HF checkpoint directory, in `dtype` on `device`, in eval mode.

    progress: show a tqdm bar (None: only for checkpoints over 1 GiB).
    A tied checkpoint (`tie_word_embeddings`) may carry an `lm_head.weight`; it is not read.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    config = Qwen3VLConfig.from_pretrained(model_dir)
    files, weight_map = checkpoint_files(model_dir)
    plan = hf_weight_plan(config)
    headers = _read_headers(files, weight_map)
    names = _validate(plan, headers, config.tie_word_embeddings)

    with torch.device("meta"):
        model = Qwen3VLModel(config)
    model = model.to(dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    rows_filled = {p: 0 for p in params}

    total = sum(headers[n].nbytes for n in names)
    show = progress if progress is not None else total >= _PROGRESS_MIN_BYTES
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {Path(model_dir).name}")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(headers[n].file, []).append(n)
    with torch.no_grad():
        for path, file_names in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in file_names:
                    slot = plan[name]
                    dst = params[slot.param].narrow(0, slot.row_start, slot.shape[0])
                    dst.copy_(f.get_tensor(name).reshape(dst.shape))
                    rows_filled[slot.param] += slot.shape[0]
                    if bar is not None:
                        bar.update(headers[name].nbytes)
    if bar is not None:
        bar.close()
    unfilled = sorted(p for p, r in rows_filled.items() if r != params[p].shape[0])
    if unfilled:  # the plan covers every parameter; this guards the plan itself
        raise MissingTensorError(f"parameters not fully covered by the checkpoint: {unfilled[:8]}")
    model.requires_grad_(False)
    return model.eval()
