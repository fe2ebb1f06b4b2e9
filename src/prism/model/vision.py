"""Qwen3-VL vision encoder: patch embedding, interpolated learned positions, 2D rotary, packed
per-frame attention blocks, the patch merger and the DeepStack mergers.

Owns: turning patchified pixels [P, C*T*p*p] (HF's layout: patches in spatial-merge-block order,
each flattened as (C, T, p, p)) plus each item's (t, h, w) grid into one LM-sized feature per merged
token and one DeepStack feature per configured block. Attention runs within each temporal frame
group of each item (as HF does: cu_seqlens over h*w per frame), never across items, so an item's
features do not depend on what it is batched with. On CUDA a residual add and the LayerNorm after it
are one kernel (`ops.layer_norm`, about one ulp from the two torch ops) and a tanh-GELU runs inside its
GEMM, one bf16 rounding fewer than HF's separate GELU: the features differ from HF's by more than an ulp
(up to 0.047 on W1's images at 8B shapes; greedy tokens unchanged). Grid metadata (interpolation taps, rotary
positions, segment lengths) is computed on the host from the grid list and cached per grid.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.host_copy import to_device
from ..ops.layer_norm import add_layer_norm
from ..ops.vision_rope import vision_rope
from .attention import dense_varlen_attention, plan_free_sdpa
from .config import VisionConfig

Grid = tuple[int, int, int]
# On CUDA, a tanh-GELU MLP's activation runs as its first GEMM's epilogue (`VisionBlock.mlp`). A module knob so
# that a benchmark can compare it with HF's separate GELU in one process.
GELU_IN_GEMM = True


def normalize_grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> tuple[Grid, ...]:
    """(t, h, w) per item as host ints (one sync if given a device tensor)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
    grids = []
    for row in rows:
        if len(row) != 3 or any(int(x) <= 0 for x in row):
            raise ValueError(f"each grid must be 3 positive ints (t, h, w), got {row}")
        grids.append((int(row[0]), int(row[1]), int(row[2])))
    return tuple(grids)


@functools.lru_cache(maxsize=256)
def _grid_meta(
    t: int, h: int, w: int, side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one item: bilinear taps [t*h*w, 4] and weights [t*h*w, 4] into the side x side learned
    grid (align_corners=True), and (row, col) rotary positions [t*h*w, 2], in merge-block order."""
    if h % merge or w % merge:
        raise ValueError(f"grid {(t, h, w)} is not divisible by spatial_merge_size {merge}")
    p = torch.arange(h * w, device="cpu")
    in_col = p % merge
    in_row = (p // merge) % merge
    block_col = (p // (merge * merge)) % (w // merge)
    block_row = p // (merge * merge * (w // merge))
    row = block_row * merge + in_row
    col = block_col * merge + in_col

    def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.to(torch.float32) * (side - 1) / torch.tensor(max(size - 1, 1), device="cpu")
        floor = torch.floor(src)
        offsets = torch.arange(2, device="cpu")
        tap = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weight = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return tap, weight

    h_tap, h_w = taps(row, h)
    w_tap, w_w = taps(col, w)
    idx = (h_tap[:, :, None] * side + w_tap[:, None, :]).reshape(-1, 4)
    wts = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    pos = torch.stack([row, col], dim=-1)
    return idx.repeat(t, 1), wts.repeat(t, 1), pos.repeat(t, 1)


@dataclass(frozen=True)
class VisionOutput:
    """embeds [M, out_hidden] (merged tokens of all items, in item order); deepstack
    [num_deepstack, M, out_hidden]; tokens_per_item: merged tokens of each item."""

    embeds: torch.Tensor
    deepstack: torch.Tensor
    tokens_per_item: tuple[int, ...]


@dataclass(frozen=True)
class GridMetadata:
    """The items' grids and what the encoder derives from them: bilinear taps [P, 4] and weights [P, 4] into
    the learned position grid, rotary cos / sin [P, head_dim / 2] (fp32), attention segment lengths (one per
    frame of each item). The tensors are on the encoder's device, the grids and lengths host ints."""

    grids: tuple[Grid, ...]
    taps: torch.Tensor
    tap_weights: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    seq_lens: tuple[int, ...]


def _act(name: str):
    if name == "gelu_pytorch_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported vision activation {name!r}")


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        e = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(e, eps=1e-6)
        self.norm2 = nn.LayerNorm(e, eps=1e-6)
        self.qkv = nn.Linear(e, 3 * e, bias=True)
        self.proj = nn.Linear(e, e, bias=True)
        self.fc1 = nn.Linear(e, cfg.intermediate_size, bias=True)
        self.fc2 = nn.Linear(cfg.intermediate_size, e, bias=True)
        self.act = _act(cfg.hidden_act)
        self.gelu_tanh = cfg.hidden_act == "gelu_pytorch_tanh"

    def attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: Sequence[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = vision_rope(q, k, cos, sin)  # in fp32, back to the activation dtype (HF's order)
        out = dense_varlen_attention(q, k, v, seq_lens, causal=False)
        return self.proj(out.reshape(n, -1))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh and h.is_cuda and GELU_IN_GEMM:
            # The bias and tanh-GELU as the GEMM's epilogue (cuBLASLt), on the fp32 accumulator: one pass over
            # the [patches, intermediate] activation fewer, one rounding fewer than HF's separate GELU.
            return self.fc2(torch._addmm_activation(self.fc1.bias, h, self.fc1.weight.t(), use_gelu=True))
        return self.fc2(self.act(self.fc1(h)))

    def forward(self, x, cos, sin, seq_lens: Sequence[int]) -> torch.Tensor:
        """One block alone, in HF's order of operations (the encoder chains its blocks' residual adds into the
        next norm; on CUDA the MLP's GELU runs in its GEMM either way, see `mlp`)."""
        x = x + self.attention(self.norm1(x), cos, sin, seq_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each merge x merge block of patches and project to the LM width.

    The final merger normalizes each patch before the concatenation; the DeepStack mergers
    normalize the concatenated vector ("post-shuffle").
    """

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged_dim = cfg.merged_dim
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(cfg.merged_dim if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.fc1 = nn.Linear(cfg.merged_dim, cfg.merged_dim, bias=True)
        self.fc2 = nn.Linear(cfg.merged_dim, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_mergers = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )
        self._deepstack_at = {blk: j for j, blk in enumerate(cfg.deepstack_visual_indexes)}
        rot_dim = cfg.head_dim // 2
        # Explicit CPU: the model may be constructed under a `meta` device context.
        steps = torch.arange(0, rot_dim, 2, dtype=torch.float32, device="cpu")
        self._inv_freq = 1.0 / (cfg.rope_theta ** (steps / rot_dim))

    def grid_metadata(self, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> GridMetadata:
        """Everything the encoder needs to know of the items' grids, on its device (host work and host-to-device
        copies: done before a CUDA graph capture, not inside it)."""
        grids = normalize_grids(grid_thw)
        device = self.patch_embed.weight.device
        side, merge = self.cfg.num_grid_per_side, self.cfg.spatial_merge_size
        metas = [_grid_meta(t, h, w, side, merge) for t, h, w in grids]
        idx = to_device(torch.cat([m[0] for m in metas]), device)
        wts = to_device(torch.cat([m[1] for m in metas]), device)
        pos = torch.cat([m[2] for m in metas]).to(torch.float32)
        freqs = (pos[:, :, None] * self._inv_freq).flatten(1)  # [P, rot_dim]: h freqs then w freqs
        emb = to_device(torch.cat((freqs, freqs), dim=-1), device)
        seq_lens = tuple(h * w for t, h, w in grids for _ in range(t))
        return GridMetadata(grids, idx, wts, emb.cos(), emb.sin(), seq_lens)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> VisionOutput:
        """The encoder run eagerly, its attention by a backend that needs no per-shape plan (`plan_free_sdpa`):
        an eager call is typically a grid list seen for the first time, where cuDNN's plan would cost ~55 ms
        in the step, beside whatever decodes. A captured grid list (`engine.vision_graphs`, `encode` called
        directly) keeps PyTorch's choice, cuDNN on Hopper (1.5x faster at 8 images): its plan is built once,
        at the capture, which is a one-time cost per list anyway. The two round differently, so an image's
        features depend on whether its grid list was captured yet (deterministic mode captures with this call's
        backends: `engine.vision_graphs.capture_encoder`'s `plan_free`)."""
        with plan_free_sdpa():
            return self.encode(pixel_values, self.grid_metadata(grid_thw))

    def encode(self, pixel_values: torch.Tensor, meta: GridMetadata) -> VisionOutput:
        """The encoder over patches of the grids `meta` describes: device work only (CUDA-graph capturable)."""
        grids = meta.grids
        n_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (n_patches, self.cfg.patch_dim):
            raise ValueError(
                f"pixel_values must be [{n_patches}, {self.cfg.patch_dim}] for grids {list(grids)}, "
                f"got {tuple(pixel_values.shape)}"
            )
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(pixel_values.to(device=self.patch_embed.weight.device, dtype=dtype))
        pos = (self.pos_embed(meta.taps) * meta.tap_weights[:, :, None]).sum(1)
        x = x + pos.to(dtype)
        deepstack = []
        # Each residual add is fused with the norm that reads its sum (`add_layer_norm`): norm2 of the same
        # block, norm1 of the next. h is the normed input of the block's next half, x the residual stream.
        blocks = self.blocks
        h = blocks[0].norm1(x) if len(blocks) else x
        for i, blk in enumerate(blocks):
            norm2 = blk.norm2
            h, x = add_layer_norm(blk.attention(h, meta.cos, meta.sin, meta.seq_lens), x, norm2.weight,
                                  norm2.bias, norm2.eps)
            delta = blk.mlp(h)
            if i + 1 < len(blocks):
                norm1 = blocks[i + 1].norm1
                h, x = add_layer_norm(delta, x, norm1.weight, norm1.bias, norm1.eps)
            else:
                x = x + delta
            j = self._deepstack_at.get(i)
            if j is not None:
                deepstack.append(self.deepstack_mergers[j](x))
        embeds = self.merger(x)
        unit = self.cfg.spatial_merge_size**2
        ds = torch.stack(deepstack) if deepstack else embeds.new_zeros((0, *embeds.shape))
        return VisionOutput(embeds, ds, tuple(t * h * w // unit for t, h, w in grids))
