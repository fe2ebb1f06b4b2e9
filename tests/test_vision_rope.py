"""The vision rope kernel (`ops.vision_rope`) against HF's fp32 arithmetic, and the encoder using it.

Run under the Triton interpreter on the CPU (fp32 and fp16; the interpreter is not trusted for bf16), with
the strided q/k views of the fused qkv output and a head dim whose half is not a power of two (the 8B
encoder's is 72). A planted bug (a wrong rotation) must break the comparison. The bitwise check in bf16,
where a fused multiply-add would show, runs on the GPU (`tests/gpu/test_kernels_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from prism.ops import vision_rope as vr
from prism.ops.kv_write import HAVE_TRITON

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n: int, heads: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(n, 3 * heads * d, generator=g) * 3).to(DEV, dtype)
    q, k, _ = qkv.view(n, 3, heads, d).unbind(1)
    pos = torch.randint(0, 64, (n, 2), generator=g).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2))
    freqs = (pos[:, :, None] * inv).flatten(1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(DEV), emb.sin().to(DEV)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d", [(2, 16), (3, 72), (16, 72)])
def test_kernel_equals_the_fp32_reference_bitwise(dtype, heads, d):
    q, k, cos, sin = _inputs(5, heads, d, dtype, seed=heads + d)
    got_q, got_k = vr.vision_rope(q, k, cos, sin, use_triton=True)
    want_q, want_k = vr.vision_rope_reference(q, k, cos, sin)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        assert torch.equal(got, want)


@needs_triton
def test_a_wrong_rotation_fails_the_comparison(monkeypatch):
    """Planted bug: a reference rotating the other way must not equal the kernel."""
    q, k, cos, sin = _inputs(4, 2, 16, torch.float32, seed=1)
    got_q, _ = vr.vision_rope(q, k, cos, sin, use_triton=True)
    monkeypatch.setattr(vr, "rotate_half", lambda x: torch.cat((x.chunk(2, -1)[1], -x.chunk(2, -1)[0]), -1))
    wrong_q, _ = vr.vision_rope_reference(q, k, cos, sin)
    assert (got_q - wrong_q).abs().max() > 1e-2


def test_bad_shapes_and_dtypes_are_refused():
    q, k, cos, sin = _inputs(3, 2, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="float32"):
        vr.vision_rope(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="expected"):
        vr.vision_rope(q, k[:2], cos, sin)


@needs_triton
def test_an_encoder_block_through_the_kernel_equals_the_block_through_the_reference(monkeypatch):
    """The encoder's attention rotates through `vision_rope`: a block run with the kernels forced on (the
    interpreter) gives the block's reference result, and a kernel rotating the wrong way would not."""
    from prism.model import vision
    from prism.model.config import VisionConfig

    cfg = VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
                       deepstack_visual_indexes=(), num_position_embeddings=16, patch_size=2,
                       temporal_patch_size=2, spatial_merge_size=2)
    torch.manual_seed(0)
    blk = vision.VisionBlock(cfg).to(DEV)
    x = torch.randn(6, 32, device=DEV)
    _, _, cos, sin = _inputs(6, 2, 16, torch.float32, seed=3)
    with torch.inference_mode():
        reference = blk(x, cos, sin, [6])
        monkeypatch.setenv("PRISM_KERNELS", "triton")
        kernel = blk(x, cos, sin, [6])
        monkeypatch.setattr(vision, "vision_rope", lambda q, k, c, s: vr.vision_rope(q, k, c, -s))
        wrong = blk(x, cos, sin, [6])
    torch.testing.assert_close(kernel, reference, rtol=1e-6, atol=1e-6)
    assert (wrong - reference).abs().max() > 1e-3
