"""The persistent chain of `bench/layer_chain_probe.py` computes what it claims (Triton interpreter, fp32, one
program: the interpreter runs a grid's programs one after another, so a grid-wide barrier can only pass with one).
On the GPU the probe checks every configuration again (each GEMV of the first layer against the fp32 product, the
whole chain bitwise run to run) before timing it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import layer_chain_probe as probe  # noqa: E402


def _reference_chain(chain: probe.Chain, layers: int) -> torch.Tensor:
    h = chain.x0.double()
    for layer in range(layers):
        q = chain.wqkv[layer].double() @ h
        a = chain.wo[layer].double() @ q[: chain.hidden]
        g = chain.wgu[layer].double() @ a
        h = chain.wdown[layer].double() @ g[: chain.inter]
    return h


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_persistent_chain_is_the_chained_products(prefetch):
    chain = probe.Chain(layers=2, hidden=64, qkv=96, inter=128, device="cpu", dtype=torch.float32)
    got = probe.run_persistent(chain, programs=1, block_n=8, block_k=16, warps=4, stages=2, prefetch=prefetch)
    torch.testing.assert_close(got.double(), _reference_chain(chain, 2), rtol=1e-4, atol=1e-4)


def test_the_first_layer_check_catches_a_wrong_gemv(monkeypatch):
    # The probe's own guard: a phase that skipped its last column tile must read as wrong.
    chain = probe.Chain(layers=1, hidden=64, qkv=96, inter=128, device="cpu", dtype=torch.float32)

    def run(layers=None):
        probe.run_persistent(chain, 1, 8, 16, 4, 2, 0, layers=layers)
        chain.a.copy_(chain.wo[0][:, :48] @ chain.q[:48])  # O without its last 16 columns
        return chain.h

    assert probe.check_first_layer(chain, run) > 0.05
    assert probe.check_first_layer(chain, lambda layers=None: probe.run_persistent(chain, 1, 8, 16, 4, 2, 1,
                                                                                   layers=layers)) < 1e-4
