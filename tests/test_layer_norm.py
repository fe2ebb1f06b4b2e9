"""The vision encoder's fused residual add + LayerNorm (`ops.layer_norm`) against its torch reference."""

import pytest
import torch

from prism.ops import layer_norm as ln
from prism.ops.kv_write import HAVE_TRITON

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [16, 72, 1152])
def test_add_layer_norm_kernel_matches_reference(dtype, d):
    """Rows of any width (padded to a power of two inside the kernel), strided rows: the sum bitwise, the
    normed output within one ulp of the dtype (only the order of the statistics' sums differs)."""
    g = torch.Generator().manual_seed(d)
    delta = (torch.randn(7, d + 5, generator=g) * 3).to(dtype)[:, :d]  # row stride != D
    residual = (torch.randn(7, d, generator=g) + 1.5).to(dtype)
    weight = torch.randn(d, generator=g).to(dtype)
    bias = torch.randn(d, generator=g).to(dtype)
    ref_out, ref_sum = ln.add_layer_norm_reference(delta, residual, weight, bias, 1e-6)
    out, summed = ln.add_layer_norm(delta, residual, weight, bias, 1e-6, use_triton=True)
    assert torch.equal(summed, ref_sum)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol * 8, rtol=tol)


def test_add_layer_norm_refuses_mismatched_shapes():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="same"):
        ln.add_layer_norm(x, torch.zeros(3, 9), torch.ones(8), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ln.add_layer_norm(x, x, torch.ones(9), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="share one of"):
        ln.add_layer_norm(x, x.half(), torch.ones(8), torch.zeros(8), 1e-6)
    with pytest.raises(ValueError, match="share one of"):
        ln.add_layer_norm(x.double(), x.double(), torch.ones(8), torch.zeros(8), 1e-6)


@needs_triton
def test_add_layer_norm_kernel_takes_strided_weights_and_rows():
    """A weight, bias or row whose last dim is strided is made contiguous for the kernel, not misread."""
    g = torch.Generator().manual_seed(8)
    delta = torch.randn(5, 12, generator=g)
    residual = torch.randn(12, 5, generator=g).t()  # last stride 5
    weight, bias = torch.randn(12, 2, generator=g).unbind(1)  # strided vectors
    want = ln.add_layer_norm_reference(delta, residual, weight, bias, 1e-6)
    got = ln.add_layer_norm(delta, residual, weight, bias, 1e-6, use_triton=True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_reference_is_the_two_torch_ops():
    g = torch.Generator().manual_seed(3)
    delta, residual = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    weight, bias = torch.randn(10, generator=g), torch.randn(10, generator=g)
    out, summed = ln.add_layer_norm(delta, residual, weight, bias, 1e-6)  # CPU: the reference
    assert torch.equal(summed, residual + delta)
    assert torch.equal(out, torch.nn.functional.layer_norm(residual + delta, (10,), weight, bias, 1e-6))
