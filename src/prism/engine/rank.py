"""One rank's device side: load, shard, agree on KV capacity, build the runner.

Owns the order of a rank's start-up, the same on every rank (rank 0 in the engine, followers in
`engine/tp_workers.py`): the text decoder is sharded before the KV pool is sized (a rank holds
num_kv_heads / tp heads), and the page count is the MIN over ranks, agreed before any pool is
allocated (invariant 10, `distributed/capacity.py`), and a rank's start ends with READY (`finish_start`: rank 0
returns only once every follower has finished its own). With one rank the group is trivial and this is
the single-GPU engine's set-up. Also owns *every rank has a device of its own*: on CUDA the ranks take
`tensor_parallel_size` devices from the configured one on, and a host without them is a ConfigError before any
rank starts (`check_rank_devices`); on the CPU the ranks are processes of this host over gloo (how the tests run
tensor parallelism) and need no device.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..distributed.capacity import agree_num_pages
from ..distributed.tensor_parallel import TPGroup, shard_text_decoder
from ..model.loading import load_model
from ..model.text import set_batch1_gemv
from .config import ConfigError, EngineConfig
from .runner import ModelRunner
from .tp_startup import LOADED, READY


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """This rank's device: tensor-parallel on CUDA, the configured device's index + rank (cuda:rank from "cuda"),
    else the configured device."""
    device = config.resolved_device()
    if device.type == "cuda" and config.tensor_parallel_size > 1:
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def check_rank_devices(config: EngineConfig) -> None:
    """Raise ConfigError unless this host has a device for every rank (`rank_device`; one rank included: a
    `device="cuda:7"` on a host of two GPUs)."""
    tp, device = config.tensor_parallel_size, config.resolved_device()
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + tp <= count:
        return
    if tp == 1:
        raise ConfigError(f"device={config.device!r} needs CUDA device {first}, but this host has {count} "
                          "(torch.cuda.device_count())")
    raise ConfigError(f"tensor_parallel_size={tp} needs {tp} CUDA devices (cuda:{first} to cuda:{first + tp - 1}, "
                      f"from device={config.device!r}), but this host has {count} "
                      "(torch.cuda.device_count()): lower tensor_parallel_size, or run the ranks on the CPU "
                      "(device='cpu')")


def kv_setting(config: EngineConfig) -> tuple[str, int]:
    """The config key that sizes the KV pool, and its value (what a pool too large for the device names)."""
    if config.num_gpu_pages:
        return "num_gpu_pages", config.num_gpu_pages
    return "kv_memory_bytes", config.kv_memory_bytes


def build_rank_runner(model_dir: str | Path, config: EngineConfig, group: TPGroup,
                      reach: Callable[[str], None] | None = None) -> tuple[ModelRunner, int]:
    """(this rank's runner, max_model_len). Raises KVCapacityError on every rank if one has no room (no page in its
    budget, a pool its device's free memory cannot hold, or a swap pool its host cannot give:
    `capacity.allocate_kv_pools`). `reach`: called with LOADED once the model is loaded and sharded, before the first
    collective, and with READY once the runner is built (`finish_start`) (`tp_startup`: rank 0 waits there for every
    follower, a follower reports)."""
    model = load_model(Path(model_dir), dtype=config.resolved_dtype(), device=rank_device(config, group.rank))
    text = model.config.text
    kv_heads = text.num_key_value_heads
    if group.world_size > 1:
        kv_heads = shard_text_decoder(model, group).num_kv_heads
    set_batch1_gemv(model, config.batch1_gemv, fused_norms=config.batch1_fused_norms)
    if reach is not None:
        reach(LOADED)
    local = config.kv_pages(text.num_hidden_layers, kv_heads, text.head_dim)
    layout = config.kv_layout(text.num_hidden_layers, kv_heads, text.head_dim, agree_num_pages(group, local))
    max_model_len = config.resolved_max_model_len(layout.num_slots)
    runner = ModelRunner(
        model,
        layout,
        config.num_cpu_pages,
        config.encoder_cache_bytes,
        cuda_graph_max_batch=config.cuda_graph_max_batch if config.cuda_graphs else None,
        max_model_len=max_model_len,
        deterministic=config.deterministic,
        group=group,
        graph_rows_without_cuda=config.graph_rows_without_cuda,
        packed_graph_max_tokens=config.cuda_graph_max_packed_tokens,
        max_num_seqs=config.max_num_seqs,
        cascade_min_batch=config.cascade_attention_min_batch,
        vision_graphs=config.vision_cuda_graphs if config.cuda_graphs else 0,
        programmatic_launch=config.programmatic_launch,
        background_encoding=config.encode_media_ahead and config.encodes_ahead_beside_decodes,
        check_invariants=config.check_invariants,
        kv_setting=kv_setting(config),
    )
    try:
        finish_start(reach)
    except BaseException:
        try:
            runner.release_cuda_graphs()  # they pin the communicators that leaving the group aborts (`tp_workers`)
        finally:
            del runner  # its KV pools do not outlive the failed start while its error lives
        raise
    return runner, max_model_len


def finish_start(reach: Callable[[str], None] | None) -> None:
    """The last step of a rank's start, once its runner is built (pools, warm-up, CUDA graphs): `reach(READY)`. A
    follower reports it has finished; rank 0 waits until every follower has, and fails if one died or raised at any
    point of its start (without it rank 0's start returned an engine whose follower had died after its KV pools:
    `reproducers/tp_start_returned_with_dead_follower.py`)."""
    if reach is not None:
        reach(READY)
