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
