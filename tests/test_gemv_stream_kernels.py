"""The experiment kernels of `bench/gemv_stream.py` compute what they claim (Triton interpreter, fp32): a result
the sweep ranks must be the product, or the ranking measures something else. (On the GPU the sweep checks each
variant against the fp32 product again before timing it.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gemv_stream  # noqa: E402


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(128, 1024, generator=torch.Generator().manual_seed(0)) * 0.02


def test_the_read_only_kernel_sums_each_row(weight):
    torch.testing.assert_close(gemv_stream.read_only(weight, 8, 256, 4, 3), weight.sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("programs", [1, 3, 16])
def test_the_persistent_gemv_is_the_product_for_any_grid(weight, programs):
    x = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gemv_stream.persistent_gemv(weight, x, programs, 8, 256, 4, 3), weight @ x,
                               rtol=1e-5, atol=1e-5)


def test_the_tma_gemv_is_the_product(weight):
    x = torch.randn(1024, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(gemv_stream.tma_gemv(weight, x, 3, 16, 256, 4, 3), weight @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,split", [(5, 1), (32, 2), (17, 4)])
def test_the_swap_ab_gemm_is_the_product(weight, rows, split):
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(gemv_stream.swap_ab_gemm(x, weight, 64, 128, 4, 3, split), x @ weight.T,
                               rtol=1e-4, atol=1e-4)
