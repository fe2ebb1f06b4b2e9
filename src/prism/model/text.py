"""Qwen3-VL language decoder over packed tokens: RMSNorm, GQA attention with per-head Q/K RMSNorm,
interleaved M-RoPE, SwiGLU MLP, and DeepStack injection.

Owns: the decoder's arithmetic, op for op in HF's order and dtypes (RMSNorm in fp32 then scaled in
the activation dtype; cos/sin built in fp32 and cast to the activation dtype), so that our logits
match HF's. Inputs are flat: embeddings [N, H], positions [3, N] (t, h, w) and an attention backend
that owns the batch layout. Weight layout: q/k/v are one fused `qkv` row block [q | k | v] and the
MLP's gate/up one `gate_up` block [gate | up] (the loader fills them from HF's separate tensors). A one-row step
(a decode of one sequence) may instead run each layer with its residual adds and norms folded into its GEMVs
(`DecoderLayer.forward_one_row`, `ops.gemv.ResidualRow`): the same roundings, fewer kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops import gemv
from ..ops.fused_norms import add_rms_norm, qk_norm_rope, rms_norm, rotate_half, silu_and_mul
from ..ops.fused_norms import apply_rope_reference as apply_rope
from .attention import AttentionBackend
from .config import TextConfig

__all__ = ["DecoderLayer", "MRoPE", "RMSNorm", "TextDecoder", "apply_rope", "rotate_half"]


class RMSNorm(nn.Module):
    """HF's RMSNorm (`ops.fused_norms.rms_norm`: one kernel on CUDA, the torch reference elsewhere)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecodeLinear(nn.Linear):
    """`nn.Linear` whose one-row products (a decode step of one sequence) stream the weight through
    `ops.gemv` when `batch1_gemv` is set (`set_batch1_gemv`; QKV, O and down, where cuBLAS is slow at batch 1; the
    MLP's gate/up goes through a GEMV that applies the activation too, `TextMLP`)."""

    batch1_gemv = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch1_gemv:
            return gemv.linear(x, self.weight, self.bias)
        return super().forward(x)


def set_batch1_gemv(model: nn.Module, enabled: bool, *, fused_norms: bool = True) -> int:
    """Turn `ops.gemv` on or off for every layer of `model` that has it (`batch1_gemv`); returns how many. With
    `fused_norms` (and `enabled`; the default, as `EngineConfig.batch1_fused_norms`'s), one-row steps also fold each
    decoder layer's residual adds and norms into its GEMVs (`DecoderLayer.forward_one_row`)."""
    layers = [m for m in model.modules() if hasattr(m, "batch1_gemv")]
    for m in layers:
        m.batch1_gemv = enabled
    for m in model.modules():
        if isinstance(m, DecoderLayer):
            m.batch1_fused_norms = enabled and fused_norms and m.can_fold_norms()
    return len(layers)


class MRoPE:
    """Interleaved multimodal rotary embedding: frequency j rotates by the t, h or w position.

    With sections (s_t, s_h, s_w): frequency j uses h if j % 3 == 1 and j < 3 * s_h, w if
    j % 3 == 2 and j < 3 * s_w, else t. Holds no parameters (nothing to load, nothing on `meta`).
    """

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int]):
        half = head_dim // 2
        # Explicit CPU: the model may be constructed under a `meta` device context.
        axis = torch.zeros(half, dtype=torch.long, device="cpu")
        for j in range(half):
            if j % 3 == 1 and j < 3 * section[1]:
                axis[j] = 1
            elif j % 3 == 2 and j < 3 * section[2]:
                axis[j] = 2
        self.axis = axis
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
        )
        self._device_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device_cache:
            self._device_cache[device] = (self.axis.to(device), self.inv_freq.to(device))
        return self._device_cache[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, N] -> cos, sin [N, head_dim] in `dtype`."""
        axis, inv_freq = self._on(positions.device)
        pos = positions.to(torch.float32).index_select(0, axis)  # [half, N]: each frequency's axis
        freqs = pos.transpose(0, 1) * inv_freq  # [N, half]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = DecodeLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = DecodeLinear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend, layer_idx: int
    ) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv(x), cos, sin, backend, layer_idx))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
               layer_idx: int) -> torch.Tensor:
        """qkv [N, q + 2 kv] (the projection's output) -> the attention's output [N, q], before the O projection."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attend_unrotated = getattr(backend, "attend_unrotated", None)  # norm + rope + K/V write fused (paged KV)
        if attend_unrotated is not None:
            out = attend_unrotated(layer_idx, q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                   cos, sin)
        else:
            q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
            out = backend.attend(layer_idx, q, k, v)
        return out.reshape(n, self.q_size)


class TextMLP(nn.Module):
    """gate_up's rows are [gate | up] (tensor parallel: this rank's gate block, then its up block). With
    `batch1_gemv`, a one-row step runs the product and the activation as one GEMV (`ops.gemv.silu_and_mul_linear`)."""

    batch1_gemv = False

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = DecodeLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch1_gemv and self.gate_up.bias is None:  # (Qwen3's MLP has none; the fused GEMV adds none)
            return self.down_proj(gemv.silu_and_mul_linear(x, self.gate_up.weight))
        return self.down_proj(silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    batch1_fused_norms = False  # `set_batch1_gemv`: one-row steps through `forward_one_row`

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = TextMLP(cfg)

    def forward(self, residual: torch.Tensor, pending: torch.Tensor | None, cos, sin, backend: AttentionBackend,
                layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the residual stream. `pending` is the previous layer's MLP output not yet added to
        `residual` (None when there is none): every residual add runs fused into the norm that reads its sum,
        with the same roundings as HF's separate add. Returns (residual, this layer's MLP output as the next
        `pending`)."""
        attn_norm, mlp_norm = self.input_layernorm, self.post_attention_layernorm
        if pending is None:
            normed = attn_norm(residual)
        else:
            normed, residual = add_rms_norm(pending, residual, attn_norm.weight, attn_norm.eps)
        attn = self.self_attn(normed, cos, sin, backend, layer_idx)
        normed, residual = add_rms_norm(attn, residual, mlp_norm.weight, mlp_norm.eps)
        return residual, self.mlp(normed)

    def can_fold_norms(self) -> bool:
        """Whether this layer's modules let `forward_one_row` serve it: its O and down projections whole on this
        device without a bias (not row-parallel: their epilogue adds the residual; nor a bias, which the GEMVs do
        not add), no bias on gate/up, and its four weights of one dtype and device with contiguous rows. Decided
        by `set_batch1_gemv` (called once the model is loaded and sharded), not on every step."""
        attn, mlp = self.self_attn, self.mlp
        weights = (attn.qkv.weight, attn.o_proj.weight, mlp.gate_up.weight, mlp.down_proj.weight)
        return (type(attn.o_proj) is DecodeLinear and type(mlp.down_proj) is DecodeLinear
                and attn.o_proj.bias is None and mlp.down_proj.bias is None and mlp.gate_up.bias is None
                and all(w.dtype == weights[0].dtype and w.device == weights[0].device and w.stride(1) == 1
                        for w in weights))

    def folds_norms_into_gemvs(self, x: torch.Tensor) -> bool:
        """Whether `forward_one_row` serves a step whose input is `x`: folding set for this layer (`can_fold_norms`)
        and `x` one row the GEMV takes against its weights (which share the QKV weight's dtype and device)."""
        return self.batch1_fused_norms and gemv.takes_gemv(x, self.self_attn.qkv.weight)

    def forward_one_row(self, stream: torch.Tensor | gemv.ResidualRow, cos, sin, backend: AttentionBackend,
                        layer_idx: int) -> gemv.ResidualRow:
        """This layer for one row with its residual adds and RMSNorms folded into the GEMVs (`ops.gemv.ResidualRow`):
        QKV with the input norm, O with the residual add, gate/up with the norm and the activation, down with the
        add. Seven kernels instead of nine, the same roundings. `stream`: the previous layer's row, or layer 0's plain
        [1, H] input (the embeddings), normed here by the norm kernel. (A step with DeepStack features, whose rows
        are visual tokens, never comes here: `TextDecoder.forward` keeps it on the unfolded path.)"""
        attn, mlp = self.self_attn, self.mlp
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if isinstance(stream, gemv.ResidualRow):
            h = stream.h
            qkv = gemv.gemv_rms_normed(attn.qkv.weight, stream, norm.weight, norm.eps)
        else:
            h = stream[0].contiguous()
            qkv = gemv.gemv(attn.qkv.weight, norm(stream)[0].contiguous())
        if attn.qkv.bias is not None:
            qkv = qkv + attn.qkv.bias
        out = attn.attend(qkv[None], cos, sin, backend, layer_idx)
        mid = gemv.gemv_add_residual(attn.o_proj.weight, out[0].contiguous(), h)
        act = gemv.gemv_silu_and_mul_rms_normed(mlp.gate_up.weight, mid, post.weight, post.eps)
        return gemv.gemv_add_residual(mlp.down_proj.weight, act, mid.h)


@dataclass(frozen=True)
class DeepstackInput:
    """DeepStack features for the visual tokens of this step.

    token_index: [M] int64 rows of the packed batch that hold visual tokens, or None for dense features.
    features: [num_deepstack, M, hidden] (dense: [num_deepstack, N, hidden], zeros at text rows); features[i]
    is added after decoder layer i.
    """

    token_index: torch.Tensor | None
    features: torch.Tensor


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = MRoPE(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        deepstack: DeepstackInput | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [N, H], positions [3, N] -> final-normed hidden states [N, H]."""
        n = inputs_embeds.shape[0]
        if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] != n:
            raise ValueError(f"positions must be [3, {n}], got {tuple(positions.shape)}")
        num_ds = 0
        if deepstack is not None:
            num_ds = deepstack.features.shape[0]
            if num_ds > len(self.layers):
                raise ValueError(f"{num_ds} DeepStack levels for {len(self.layers)} decoder layers")
            rows = n if deepstack.token_index is None else deepstack.token_index.shape[0]
            if deepstack.features.shape[1] != rows:
                raise ValueError("DeepStack features and token_index disagree on the number of visual tokens")
        cos, sin = self.rope.cos_sin(positions, inputs_embeds.dtype)
        if (n == 1 and num_ds == 0 and self.layers[0].folds_norms_into_gemvs(inputs_embeds)
                and all(layer.batch1_fused_norms for layer in self.layers)):  # (one dtype and device: the model's)
            stream: torch.Tensor | gemv.ResidualRow = inputs_embeds
            for i, layer in enumerate(self.layers):
                stream = layer.forward_one_row(stream, cos, sin, backend, i)
            return self.norm(stream.h[None])
        residual, pending = inputs_embeds, None
        for i, layer in enumerate(self.layers):
            residual, pending = layer(residual, pending, cos, sin, backend, i)
            if i < num_ds:  # DeepStack adds to the layer's full output: materialize it
                assert deepstack is not None
                h = residual + pending
                features = deepstack.features[i].to(h.dtype)
                if deepstack.token_index is None:
                    residual, pending = h + features, None
                else:
                    residual, pending = h.index_add(0, deepstack.token_index, features), None
        if pending is None:
            return self.norm(residual)
        return add_rms_norm(pending, residual, self.norm.weight, self.norm.eps)[0]
