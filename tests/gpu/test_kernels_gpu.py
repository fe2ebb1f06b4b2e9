"""Kernels whose promise is bitwise equality with HF's torch arithmetic, checked where it can break: on the
GPU in bf16 (the interpreter on the CPU neither fuses multiply-adds nor is trusted for bf16)."""

from __future__ import annotations

import pytest
import torch

from prism.ops import vision_rope as vr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("n", [1, 784, 6272])
def test_vision_rope_kernel_is_bitwise_hf_in_bf16(n):
    g = torch.Generator().manual_seed(n)
    heads, d = 16, 72  # Qwen3-VL-8B's vision encoder
    qkv = (torch.randn(n, 3 * heads * d, generator=g) * 3).to("cuda", torch.bfloat16)
    q, k, _ = qkv.view(n, 3, heads, d).unbind(1)
    pos = torch.randint(0, 64, (n, 2), generator=g).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2))
    emb = torch.cat([(pos[:, :, None] * inv).flatten(1)] * 2, dim=-1).cuda()
    got = vr.vision_rope(q, k, emb.cos(), emb.sin(), use_triton=True)
    want = vr.vision_rope_reference(q, k, emb.cos(), emb.sin())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("n", [1, 6272])
def test_add_layer_norm_kernel_in_bf16(n):
    """The vision encoder's fused add + LayerNorm at its width: the sum bitwise torch's, the normed output within
    one bf16 ulp of `torch.nn.LayerNorm` (the statistics' sums are ordered differently)."""
    from prism.ops import layer_norm as ln

    g = torch.Generator().manual_seed(n)
    d = 1152
    delta, residual = ((torch.randn(n, d, generator=g) * s).to("cuda", torch.bfloat16) for s in (2.0, 5.0))
    weight, bias = (torch.randn(d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    want, want_sum = ln.add_layer_norm_reference(delta, residual, weight, bias, 1e-6)
    got, got_sum = ln.add_layer_norm(delta, residual, weight, bias, 1e-6, use_triton=True)
    assert torch.equal(got_sum, want_sum)
    ulp = want.float().abs().clamp_min(2.0**-8) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert (got != want).float().mean().item() < 0.01


def test_gelu_in_gemm_is_near_the_separate_gelu():
    """`VisionBlock.mlp`'s cuBLASLt epilogue (bias + tanh-GELU on the fp32 accumulator) vs HF's linear then GELU:
    the same values up to the bf16 rounding the fusion skips."""
    from prism.model import vision

    g = torch.Generator().manual_seed(5)
    h = torch.randn(6272, 1152, generator=g).to("cuda", torch.bfloat16)
    fc1 = torch.nn.Linear(1152, 4304).to("cuda", torch.bfloat16)
    fused = torch._addmm_activation(fc1.bias, h, fc1.weight.t(), use_gelu=True)
    separate = torch.nn.functional.gelu(fc1(h), approximate="tanh")
    torch.testing.assert_close(fused.float(), separate.float(), atol=2e-2, rtol=1e-2)
    assert vision.GELU_IN_GEMM


@pytest.mark.parametrize("knob", ["_HEAVIEST_FIRST", "_HEADS_FASTEST", "_SPLIT_MASKED"])
def test_prefill_schedule_knobs_on_the_gpu(knob, monkeypatch):
    """Compiled, at 8B's head shapes over scaled-FP8 pages: the launch order changes no bit; the unmasked leading
    tiles may change the last bits (the compiler fuses their score scaling into the exponent), nothing more."""
    from prism.kv.fp8 import KVLayout, KVPool
    from prism.ops import kv_write as kw
    from prism.ops import paged_prefill as pp
    from prism.ops.attention_metadata import PagedAttentionMetadata

    lay = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, page_size=256, num_pages=16, kv_dtype="fp8")
    pool = KVPool.allocate(lay, "cuda")
    g = torch.Generator().manual_seed(12)
    prefix, new = 300, 700
    ctx = prefix + new
    table = [list(range(-(-ctx // 256)))]
    written = PagedAttentionMetadata.build([ctx], [ctx], table, 256, "cuda")
    k, v = (torch.randn(ctx, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    kw.write_kv(pool, 0, written.slot_mapping, k, v)
    meta = PagedAttentionMetadata.build([new], [ctx], table, 256, "cuda")
    q = torch.randn(new, 32, 128, generator=g).to("cuda", torch.bfloat16)
    default = pp.paged_prefill_attention(q, pool, 0, meta, num_splits=1)
    monkeypatch.setattr(pp, knob, not getattr(pp, knob))
    other = pp.paged_prefill_attention(q, pool, 0, meta, num_splits=1)
    if knob == "_SPLIT_MASKED":
        torch.testing.assert_close(other, default, atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(other, default), f"{knob} changed the prefill's numbers"
