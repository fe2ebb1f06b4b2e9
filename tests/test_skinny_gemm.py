"""Linear layers of a few rows as a Triton GEMM (prism.ops.skinny_gemm): the kernel against `F.linear` (Triton
interpreter on the CPU, fp32 / fp16: the interpreter's `tl.dot` is wrong for bf16), its dispatch (2 .. MAX_ROWS rows,
and the narrow band), and a decoder step of a few rows with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prism.ops import gemv, skinny_gemm
from prism.ops import kv_write as kw
from prism.ops.dispatch import KERNELS_ENV
from prism.ops.fused_norms import silu_and_mul_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TRITON_OK = kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 4e-3}


def _record_launches(monkeypatch, *names: str) -> list[tuple[str, tuple]]:
    """Each launch of the named kernels of `skinny_gemm`, as (name, grid), in order; the kernels still run."""
    launched = []
    for name in names:
        real = getattr(skinny_gemm, name)

        class Recorded:
            def __getitem__(self, grid, _real=real, _name=name):
                launched.append((_name, tuple(grid)))
                return _real[grid]

        monkeypatch.setattr(skinny_gemm, name, Recorded())
    return launched


@needs_triton
@pytest.mark.parametrize("m,n,k", [(2, 16, 256), (3, 37, 1000), (17, 40, 70), (32, 64, 512)])  # tails everywhere
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_skinny_gemm_matches_linear(m, n, k, dtype, split_k, monkeypatch):
    monkeypatch.setattr(skinny_gemm, "SPLIT_K", split_k)
    monkeypatch.setattr(skinny_gemm, "NARROW_SPLIT_K", split_k)
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEV)
    got = skinny_gemm.skinny_gemm(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=TOL[dtype], rtol=TOL[dtype])
    w2 = (torch.randn(2 * n, k, generator=g) * 0.05).to(dtype).to(DEV)
    got = skinny_gemm.skinny_gemm_silu_and_mul(x, w2)
    assert got.shape == (m, n)
    torch.testing.assert_close(got.float(), silu_and_mul_reference(F.linear(x.float(), w2.float())),
                               atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
def test_each_output_row_reads_its_own_row_of_x_and_each_gate_its_own_up():
    """Planted-swap check: x's rows and the [gate | up] pairs are told apart (a kernel mixing them fails here)."""
    m, n, k = 5, 16, 32
    x = torch.zeros(m, k, device=DEV)
    for i in range(m):
        x[i, i] = 1.0  # row i of the output = column i of the weight
    w = torch.zeros(2 * n, k, device=DEV)
    w[:n, :m] = torch.arange(1.0, m + 1)[None, :] * torch.arange(1.0, n + 1)[:, None] * 0.1  # gate[j, i] = 0.1 i j
    w[n:, :m] = 2.0
    got = skinny_gemm.skinny_gemm_silu_and_mul(x, w).cpu()
    gate = (torch.arange(1.0, m + 1)[:, None] * torch.arange(1.0, n + 1)[None, :]) * 0.1
    torch.testing.assert_close(got, F.silu(gate) * 2.0, atol=1e-5, rtol=1e-5)


@needs_triton
def test_split_k_takes_no_empty_split_and_launches_the_sums(monkeypatch):
    """K split over programs in whole BLOCK_K tiles: a K of 3 tiles asked for 8 splits takes 3, each with work, then
    one launch adds the partials; one split launches nothing more. A bad SPLIT_K is refused."""
    launched = _record_launches(monkeypatch, "_skinny_gemm_kernel", "_split_sums_kernel")
    monkeypatch.setattr(skinny_gemm, "BLOCK_N", 16)
    monkeypatch.setattr(skinny_gemm, "BLOCK_K", 32)
    monkeypatch.setattr(skinny_gemm, "SPLIT_K", 8)
    x, w = torch.randn(4, 96).to(DEV), torch.randn(20, 96).to(DEV)
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert launched == [("_skinny_gemm_kernel", (2, 3)), ("_split_sums_kernel", (1,))]  # 20 outputs in 16-wide tiles: 2
    launched.clear()
    monkeypatch.setattr(skinny_gemm, "SPLIT_K", 1)
    skinny_gemm.skinny_gemm(x, w)
    assert [name for name, _ in launched] == ["_skinny_gemm_kernel"]
    monkeypatch.setattr(skinny_gemm, "SPLIT_K", 0)
    with pytest.raises(ValueError, match="SPLIT_K"):
        skinny_gemm.skinny_gemm(x, w)


def _bands(monkeypatch, wide_max_rows: int) -> None:
    """The engine's band knobs (2-16 rows; the narrow band to 32 rows, 64 tiles of 64, K split in two), the wide
    band to `wide_max_rows`, on a device taken as Triton's."""
    monkeypatch.setattr(skinny_gemm, "_want_triton", lambda device, use: True)
    for knob, value in {"MAX_ROWS": 16, "NARROW_MAX_ROWS": 32, "NARROW_MAX_TILES": 64, "BLOCK_N": 64,
                        "NARROW_SPLIT_K": 2, "SPLIT_K": 1, "WIDE_MAX_ROWS": wide_max_rows}.items():
        monkeypatch.setattr(skinny_gemm, knob, value)


def _takes(rows: int, n: int, silu: bool = False) -> bool:
    """Whether a launch of `rows` rows and `n` outputs (gate/up: `n` of each) takes the kernel."""
    x, w = torch.zeros(rows, 8, dtype=torch.bfloat16), torch.zeros(2 * n if silu else n, 8, dtype=torch.bfloat16)
    return skinny_gemm.takes_skinny_gemm(x, w, silu)


def test_the_narrow_band_takes_narrow_layers_only_and_splits_them(monkeypatch):
    """Steps of MAX_ROWS + 1 .. NARROW_MAX_ROWS rows: the kernel for launches of at most NARROW_MAX_TILES output
    tiles and no activation (the 8B's O and down: 4,096 outputs, 64 tiles of 64), K split NARROW_SPLIT_K ways;
    QKV (96 tiles), gate/up and more rows keep cuBLAS. Below it every launch, split SPLIT_K ways."""
    _bands(monkeypatch, wide_max_rows=0)

    assert [_takes(rows, 4096) for rows in (1, 2, 16, 17, 32, 33)] == [False, True, True, True, True, False]
    assert [_takes(rows, 6144) for rows in (16, 17, 32)] == [True, False, False]  # QKV: 96 tiles
    assert [_takes(rows, 4096, silu=True) for rows in (16, 17)] == [True, False]  # gate/up
    assert [skinny_gemm.asked_splits(rows, 4096, False) for rows in (16, 17, 32)] == [1, 2, 2]
    monkeypatch.setattr(skinny_gemm, "NARROW_MAX_ROWS", 0)  # the band off, 2 .. MAX_ROWS on
    assert [_takes(rows, 4096) for rows in (2, 16, 17, 32)] == [True, True, False, False]
    monkeypatch.setattr(skinny_gemm, "NARROW_MAX_ROWS", 32)
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 0)  # off, the band too (its rows start past MAX_ROWS)
    assert not any(_takes(rows, 4096) for rows in (2, 17, 32))
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 16)
    monkeypatch.setattr(skinny_gemm, "NARROW_SPLIT_K", 0)
    with pytest.raises(ValueError, match="NARROW_SPLIT_K"):
        skinny_gemm.asked_splits(20, 4096, False)


def test_dispatch_without_triton_keeps_linear(monkeypatch):
    """On a machine without Triton (an optional extra) every row count keeps F.linear, the narrow band's included:
    the dispatch asks nothing of Triton before it knows the kernel can run (found by review: a tile count through
    `triton.cdiv` raised NameError for 17-32 rows)."""
    monkeypatch.setattr(skinny_gemm, "triton", None, raising=False)
    monkeypatch.setattr(skinny_gemm, "_want_triton", lambda device, use: False)
    w = torch.randn(24, 40, dtype=torch.bfloat16)
    for rows in (1, 2, 20, 40):
        x = torch.randn(rows, 40, dtype=torch.bfloat16)
        assert not skinny_gemm.takes_skinny_gemm(x, w)
        assert torch.equal(gemv.linear(x, w), F.linear(x, w))


@needs_triton
def test_a_launch_in_the_narrow_band_splits_as_asked(monkeypatch):
    """20 rows of a one-tile layer: the narrow band's launch has NARROW_SPLIT_K programs along K (not SPLIT_K's),
    then the sums; 8 rows (below the band) take SPLIT_K's."""
    launched = _record_launches(monkeypatch, "_skinny_gemm_kernel")
    for knob, value in {"MAX_ROWS": 16, "NARROW_MAX_ROWS": 32, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1,
                        "NARROW_SPLIT_K": 3}.items():
        monkeypatch.setattr(skinny_gemm, knob, value)
    w = torch.randn(16, 96).to(DEV)
    for rows in (20, 8):
        x = torch.randn(rows, 96).to(DEV)
        torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert [grid for _, grid in launched] == [(1, 3), (1, 1)]


@needs_triton
def test_an_empty_inner_dimension_gives_zeros_as_linear_does():
    x, w = torch.zeros(3, 0).to(DEV), torch.zeros(5, 0).to(DEV)
    assert torch.equal(skinny_gemm.skinny_gemm(x, w), F.linear(x, w))
    assert torch.equal(skinny_gemm.skinny_gemm_silu_and_mul(x, torch.zeros(10, 0).to(DEV)), torch.zeros(3, 5).to(DEV))


def test_skinny_gemm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="unit stride"):
        skinny_gemm.skinny_gemm(torch.zeros(4, 8), torch.zeros(6, 7))
    with pytest.raises(ValueError, match="unit stride"):
        skinny_gemm.skinny_gemm(torch.zeros(8, 4).t(), torch.zeros(6, 8))
    with pytest.raises(ValueError, match="even"):
        skinny_gemm.skinny_gemm_silu_and_mul(torch.zeros(4, 8), torch.zeros(7, 8))


@needs_triton
def test_linear_takes_the_skinny_gemm_for_a_few_rows_when_on(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "triton")
    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    half = torch.float16  # (the dispatch takes 16-bit activations only)
    w, b = (torch.randn(24, 40) * 0.2).to(half).to(DEV), torch.randn(24).to(half).to(DEV)
    x = {rows: torch.randn(rows, 40).to(half).to(DEV) for rows in (1, 2, 8, 9)}
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 0)  # off, the narrow band too
    for rows in (2, 8, 9):
        torch.testing.assert_close(gemv.linear(x[rows], w, b), F.linear(x[rows], w, b))
    assert calls == []
    monkeypatch.setattr(skinny_gemm, "NARROW_MAX_ROWS", 0)
    monkeypatch.setattr(skinny_gemm, "WIDE_MAX_ROWS", 0)
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 8)
    for rows in (1, 2, 8, 9):
        want = F.linear(x[rows].float(), w.float(), b.float())
        torch.testing.assert_close(gemv.linear(x[rows], w, b).float(), want, atol=1e-2, rtol=1e-2)
    assert calls == [2, 8], "one row goes to the GEMV, more than MAX_ROWS to F.linear"
    monkeypatch.setattr(skinny_gemm, "NARROW_MAX_ROWS", 9)  # 24 outputs: one tile, a narrow layer
    gemv.linear(x[9], w, b)
    assert calls == [2, 8, 9], "the narrow band takes 9 rows"
    assert not skinny_gemm.takes_skinny_gemm(x[2].float(), w.float()), "an fp32 model keeps F.linear"
    monkeypatch.setenv(KERNELS_ENV, "reference")
    gemv.linear(x[2], w, b)
    assert calls == [2, 8, 9], "PRISM_KERNELS=reference must keep F.linear"


@needs_triton
def test_a_decoder_step_of_a_few_rows_is_the_same_with_the_skinny_gemm(monkeypatch):
    """Three packed one-token sequences through the decoder with `batch1_gemv`: the skinny GEMM (QKV, O, down and
    the fused gate/up) against F.linear, and it was called."""
    from prism.model.attention import DenseCausalAttention
    from prism.model.config import TextConfig
    from prism.model.text import TextDecoder, set_batch1_gemv

    monkeypatch.setenv(KERNELS_ENV, "triton")
    cfg = TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=64, rope_theta=1e4, mrope_section=(4, 2, 2))
    torch.manual_seed(3)
    decoder = TextDecoder(cfg).to(DEV).half()  # (the dispatch takes 16-bit activations only)
    set_batch1_gemv(decoder, True)
    x = torch.randn(3, 64).to(DEV).half()

    def forward():
        with torch.no_grad():
            return decoder(x, torch.zeros(3, 3, dtype=torch.long, device=DEV), DenseCausalAttention([1, 1, 1]))

    want = forward()
    calls = []
    for name in ("skinny_gemm", "skinny_gemm_silu_and_mul"):
        real = getattr(skinny_gemm, name)
        monkeypatch.setattr(skinny_gemm, name, lambda a, w, _real=real, _name=name: calls.append(_name) or _real(a, w))
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 32)
    got = forward()
    assert calls.count("skinny_gemm") == 3 * 2 and calls.count("skinny_gemm_silu_and_mul") == 2  # QKV, O, down
    assert got.abs().max() > 0.1
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_the_wide_band_takes_what_the_narrow_band_leaves(monkeypatch):
    """Steps of MAX_ROWS + 1 .. WIDE_MAX_ROWS rows: the launches the narrow band does not take (the 8B's QKV, 96
    tiles; gate/up with its activation) run the swap-AB kernel, K unsplit; O and down stay in the narrow band."""
    _bands(monkeypatch, wide_max_rows=32)

    assert [_takes(rows, 6144) for rows in (16, 17, 32, 33)] == [True, True, True, False]  # QKV
    assert [_takes(rows, 12288, silu=True) for rows in (16, 17, 32, 33)] == [True, True, True, False]  # gate/up
    assert [skinny_gemm.in_wide_band(rows, 6144, False) for rows in (16, 17, 32)] == [False, True, True]
    assert not skinny_gemm.in_wide_band(20, 4096, False), "O and down belong to the narrow band"
    assert skinny_gemm.asked_splits(20, 6144, False) == 1 and skinny_gemm.asked_splits(20, 4096, False) == 2
    monkeypatch.setattr(skinny_gemm, "WIDE_MAX_ROWS", 24)
    assert [_takes(rows, 6144) for rows in (24, 25)] == [True, False]
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 0)  # off: both bands too
    assert not any(_takes(rows, 6144) for rows in (2, 17, 24))


@needs_triton
@pytest.mark.parametrize("m,n,k", [(17, 40, 70), (32, 64, 100), (20, 33, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_swap_ab_kernel_matches_linear(m, n, k, dtype, monkeypatch):
    """The wide band's swap-AB launch (small tiles, tails along every axis), plain and with the activation."""
    for knob, value in {"MAX_ROWS": 16, "WIDE_MAX_ROWS": 32, "NARROW_MAX_TILES": 1, "BLOCK_N": 16,
                        "WIDE_BLOCK_N": 16, "WIDE_BLOCK_K": 32, "WIDE_SILU_BLOCK_K": 32}.items():
        monkeypatch.setattr(skinny_gemm, knob, value)
    assert skinny_gemm.in_wide_band(m, n, False) and skinny_gemm.in_wide_band(m, n, True)
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).to(DEV)
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w).float(), F.linear(x.float(), w.float()),
                               atol=TOL[dtype], rtol=TOL[dtype])
    w2 = (torch.randn(2 * n, k, generator=g) * 0.05).to(dtype).to(DEV)
    torch.testing.assert_close(skinny_gemm.skinny_gemm_silu_and_mul(x, w2).float(),
                               silu_and_mul_reference(F.linear(x.float(), w2.float())), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [2, 8, 20, 32, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 12288)])  # the 8B's QKV, O and down
def test_skinny_gemm_matches_linear_8b_shapes_bf16(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float())
    # both round the fp32 sum to bf16 once: within one bf16 ulp of the exact product
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w).float(), want, atol=1e-3, rtol=2**-7)
    w2 = torch.randn(2 * 12288, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x2 = torch.randn(rows, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    want2 = silu_and_mul_reference(F.linear(x2.float(), w2.float()))
    torch.testing.assert_close(skinny_gemm.skinny_gemm_silu_and_mul(x2, w2).float(), want2, atol=2e-3, rtol=2**-6)


@needs_triton
def test_the_pipeline_fits_the_shared_memory_budget(monkeypatch):
    """At 64 rows in fp32 four stages of 16 x 256 tiles would need 320 KB of shared memory (the H200 has 227): the
    launch cuts the stages to fit `SHARED_MEMORY_BUDGET` instead of failing to compile."""
    launched = {}

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.update(kw)

    monkeypatch.setattr(skinny_gemm, "_skinny_gemm_kernel", Kernel())
    monkeypatch.setattr(skinny_gemm, "BLOCK_N", 16)
    monkeypatch.setattr(skinny_gemm, "BLOCK_K", 256)
    monkeypatch.setattr(skinny_gemm, "device_context", lambda device: __import__("contextlib").nullcontext())
    skinny_gemm.skinny_gemm(torch.zeros(64, 512), torch.zeros(32, 512))
    assert launched["BLOCK_M"] == 64 and launched["NUM_STAGES"] == 2  # (64 + 16) x 256 x 4 B = 80 KB a stage
    skinny_gemm.skinny_gemm(torch.zeros(8, 512, dtype=torch.float16), torch.zeros(32, 512, dtype=torch.float16))
    assert launched["BLOCK_M"] == 16 and launched["NUM_STAGES"] == skinny_gemm.NUM_STAGES
    monkeypatch.setattr(skinny_gemm, "SILU_BLOCK_N", 64)  # gate/up: its own tiles, two weight tiles a stage
    monkeypatch.setattr(skinny_gemm, "SILU_BLOCK_K", 256)
    skinny_gemm.skinny_gemm_silu_and_mul(torch.zeros(64, 512), torch.zeros(128, 512))
    assert launched["BLOCK_N"] == 64 and launched["NUM_STAGES"] == 1  # (64 + 2 x 64) x 256 x 4 B = 192 KB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_skinny_gemm_in_fp32_is_not_rounded_to_tf32():
    """An fp32 model (the TP tests' tiny checkpoint) keeps fp32 products: TF32 would miss 1e-5 by far."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(8, 1024, device="cuda", generator=g)
    w = torch.randn(256, 1024, device="cuda", generator=g) * 0.05
    want = (x.double() @ w.double().T).float()
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w), want, atol=1e-4, rtol=1e-5)

