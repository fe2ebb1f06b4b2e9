"""Tensor parallelism for the Qwen3-VL text decoder over torch.distributed.

Owns: the TP group's collectives (`TPGroup`: sum all-reduce, last-dim all-gather, MIN agreement on
a capacity) and the in-place conversion of a fully loaded `Qwen3VLModel`'s text decoder into one
rank's shard (`shard_text_decoder`). Invariant: TP == TP1, i.e. the sharded model's logits equal the
unsharded model's up to the reordering of the row-parallel partial sums, and every rank ends a
forward with the same full logits.

Layout of rank r of w (contiguous blocks, so rank r's Q heads use exactly its own KV heads):
- fused qkv: column parallel, rows [q heads r*Hq/w.. | kv heads r*Hkv/w.. of k | same of v]
- o_proj, down_proj: row parallel (input columns of this rank), all-reduce, then the bias once
- fused gate_up: column parallel, rows [gate block r | up block r] so silu(gate) * up stays local
- embedding and LM head: vocab parallel (rows [r*Vw, (r+1)*Vw), the last block zero-padded); the
  embedding masks foreign ids to zero and all-reduces (a sum with exact zeros, so it is exact),
  the LM head all-gathers its logit slices. A tied checkpoint shares one vocab shard for both.
- Q/K RMSNorm (per head, weights shared across heads), the layer norms, M-RoPE and the vision
  encoder stay replicated.
The attention backend then sees q [N, Hq/w, D] and k/v [N, Hkv/w, D]; a paged KV pool on rank r
stores only its Hkv/w heads (`TextShard.kv_heads`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.config import TextConfig
from ..model.qwen3_vl import Qwen3VLModel
from ..model.text import DecodeLinear, TextAttention, TextMLP
from ..ops import gemv


class TensorParallelError(ValueError):
    """The model cannot be split over this TP group (indivisible heads/sizes, bad group, reuse)."""


# ------------------------------------------------------------------------------------------ group
@dataclass(frozen=True)
class TPGroup:
    """One rank's view of a tensor-parallel group.

    group: the torch.distributed process group (None: the default world group, or no group at all
    when world_size == 1, in which case every collective is the identity). device: where the
    group's tensors live (cpu for gloo, this rank's cuda device for nccl).
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise TensorParallelError(f"world_size must be a positive int, got {self.world_size!r}")
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not 0 <= self.rank < self.world_size
        ):
            raise TensorParallelError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> TPGroup:
        """A world of one (TP1): no torch.distributed needed."""
        return cls(0, 1, None, torch.device(device))

    @classmethod
    def from_process_group(
        cls, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None
    ) -> TPGroup:
        """Wrap an initialized process group (None: the default group). device defaults to the
        current cuda device for nccl and cpu otherwise."""
        if not dist.is_available() or not dist.is_initialized():
            raise TensorParallelError("torch.distributed is not initialized: call init_process_group first")
        if device is None:
            backend = str(dist.get_backend(group)).lower()
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        return cls(dist.get_rank(group), dist.get_world_size(group), group, torch.device(device))

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place; returns `t`."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def broadcast_from_first(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank, in place (the others pass a tensor of its shape and dtype); returns `t`."""
        if self.world_size > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on all ranks), in rank order."""
        if self.world_size == 1:
            return [t]
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return parts

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape on all ranks) along the last dim, in rank order."""
        if self.world_size == 1:
            return t
        return torch.cat(self.all_gather(t), dim=-1)

    def min_int(self, value: int) -> int:
        """The minimum of `value` over all ranks (e.g. KV pages: every rank must allocate the same
        count). A control-plane call: one host sync, never per layer."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"min_int takes an int, got {type(value).__name__}")
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def local_init_method() -> str:
    """A tcp:// rendezvous on a free loopback port, for ranks of one host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def init_tp_group(
    rank: int,
    world_size: int,
    init_method: str | None = None,
    *,
    store: dist.Store | None = None,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> TPGroup:
    """Initialize the default process group (gloo on CPU, nccl when cuda is available) and wrap it.

    The ranks meet at `init_method` (a tcp:// rendezvous) or through `store` (one rank hosts it). For nccl,
    call torch.cuda.set_device(local rank) first. timeout_s bounds every collective, so a rank that died
    makes the others fail instead of hang.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TPGroup.from_process_group()


# ------------------------------------------------------------------------------------ shard plan
@dataclass(frozen=True)
class TextShard:
    """What rank `rank` of `world_size` holds: [start, stop) ranges in the full model's units."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # rows of the real vocab held here (the padded tail is not counted)
    vocab_shard_size: int  # rows per rank including padding: ceil(vocab / world)
    vocab_size: int

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def plan_text_shard(cfg: TextConfig, rank: int, world_size: int) -> TextShard:
    """The block of each dimension that `rank` keeps; raises TensorParallelError if one is indivisible."""
    hq, hkv, inter, w = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, world_size
    problems = []
    if hq % w:
        problems.append(f"num_attention_heads {hq}")
    if hkv % w:
        problems.append(f"num_key_value_heads {hkv}")
    if inter % w:
        problems.append(f"intermediate_size {inter}")
    if problems:
        raise TensorParallelError(
            f"tensor parallel size {w} must divide {', '.join(problems)}; KV heads are split, not replicated, "
            f"so use a TP size dividing {hkv}"
        )
    if hq % hkv:
        raise TensorParallelError(f"num_attention_heads {hq} is not a multiple of num_key_value_heads {hkv}")
    if not 0 <= rank < w:
        raise TensorParallelError(f"rank {rank} outside a group of {w}")
    v = cfg.vocab_size
    vs = -(-v // w)
    return TextShard(
        rank=rank,
        world_size=w,
        q_heads=(rank * hq // w, (rank + 1) * hq // w),
        kv_heads=(rank * hkv // w, (rank + 1) * hkv // w),
        intermediate=(rank * inter // w, (rank + 1) * inter // w),
        vocab=(min(rank * vs, v), min((rank + 1) * vs, v)),
        vocab_shard_size=vs,
        vocab_size=v,
    )


# ---------------------------------------------------------------------------------- TP modules
class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input's last dim is this rank's slice. `batch1_gemv`: one-row
    products through `ops.gemv` (as `model.text.DecodeLinear`; set by `set_batch1_gemv`)."""

    batch1_gemv = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = gemv.linear(x, self.weight) if self.batch1_gemv else F.linear(x, self.weight)
        y = self.tp.all_reduce_sum(local)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding; ids held elsewhere give zeros, then a sum over ranks."""

    def __init__(self, weight: torch.Tensor, start: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.tp = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        foreign = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        return self.tp.all_reduce_sum(out.masked_fill(foreign.unsqueeze(-1), 0))


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocab slice, all-gathered to the full [.., vocab] on every rank."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: TPGroup):
        super().__init__()
        self.weight = weight  # possibly the embedding's shard (tied checkpoints)
        self.vocab_size = vocab_size
        self.tp = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        full = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))
        return full if full.shape[-1] == self.vocab_size else full[..., : self.vocab_size]


# ------------------------------------------------------------------------------------ sharding
def _rows(t: torch.Tensor, *blocks: tuple[int, int]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in blocks], dim=0).clone()


def _vocab_rows(weight: torch.Tensor, shard: TextShard) -> torch.Tensor:
    a, b = shard.vocab
    out = weight.new_zeros(shard.vocab_shard_size, weight.shape[1])
    out[: b - a] = weight[a:b]
    return out


def _shard_attention(attn: TextAttention, shard: TextShard, group: TPGroup) -> None:
    d = attn.head_dim
    q_size, kv_size = attn.q_size, attn.kv_size
    (qa, qb), (ka, kb) = shard.q_heads, shard.kv_heads
    blocks = (
        (qa * d, qb * d),
        (q_size + ka * d, q_size + kb * d),
        (q_size + kv_size + ka * d, q_size + kv_size + kb * d),
    )
    old = attn.qkv
    qkv = DecodeLinear(old.in_features, sum(b - a for a, b in blocks), bias=old.bias is not None)
    qkv.weight = nn.Parameter(_rows(old.weight, *blocks), requires_grad=False)
    if old.bias is not None:
        qkv.bias = nn.Parameter(_rows(old.bias, *blocks), requires_grad=False)
    o = attn.o_proj
    o_weight = o.weight[:, qa * d : qb * d].clone()
    o_bias = None if o.bias is None else o.bias.clone()
    attn.qkv = qkv
    attn.o_proj = RowParallelLinear(o_weight, o_bias, group)
    attn.num_heads, attn.num_kv_heads = shard.num_q_heads, shard.num_kv_heads
    attn.q_size, attn.kv_size = shard.num_q_heads * d, shard.num_kv_heads * d


def _shard_mlp(mlp: TextMLP, shard: TextShard, group: TPGroup) -> None:
    inter = mlp.intermediate_size
    a, b = shard.intermediate
    old = mlp.gate_up
    gate_up = nn.Linear(old.in_features, 2 * (b - a), bias=False)
    gate_up.weight = nn.Parameter(_rows(old.weight, (a, b), (inter + a, inter + b)), requires_grad=False)
    down = RowParallelLinear(mlp.down_proj.weight[:, a:b].clone(), None, group)
    mlp.gate_up, mlp.down_proj = gate_up, down
    mlp.intermediate_size = b - a


def shard_text_decoder(model: Qwen3VLModel, group: TPGroup) -> TextShard:
    """Turn a fully loaded model's text decoder into this rank's TP shard, in place.

    Every rank must call it with the same checkpoint. The vision encoder is left whole (encoder data
    parallelism is separate). Raises TensorParallelError, before touching the model, if the sizes do
    not divide or the model was already sharded. Returns what this rank holds.
    """
    lm = model.language_model
    if isinstance(lm.embed_tokens, VocabParallelEmbedding):
        raise TensorParallelError("this model's text decoder is already sharded")
    shard = plan_text_shard(lm.cfg, group.rank, group.world_size)
    tied = model.lm_head is None
    with torch.no_grad():
        for layer in lm.layers:
            _shard_attention(layer.self_attn, shard, group)
            _shard_mlp(layer.mlp, shard, group)
        full_embed = lm.embed_tokens.weight
        embed = VocabParallelEmbedding(_vocab_rows(full_embed, shard), shard.vocab[0], group)
        head_weight = (
            embed.weight
            if tied
            else nn.Parameter(_vocab_rows(model.lm_head.weight, shard), requires_grad=False)
        )
        lm.embed_tokens = embed
        head = VocabParallelLMHead(head_weight, shard.vocab_size, group)
    model.lm_head = head
    # Qwen3VLModel.compute_logits reads lm_head.weight directly; route it through the TP head.
    model.compute_logits = head.forward  # type: ignore[method-assign]
    return shard
