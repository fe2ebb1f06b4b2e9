"""Cascade decode attention (prism.ops.cascade_attention): the host plan of which keys rows share, the three
launches against the torch reference (Triton interpreter on the CPU), metadata checks, and the engine's graph
rows with cascade attention against the reference engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from prism.engine.cuda_graphs import page_table
from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.kv.fp8 import KVLayout, KVPool
from prism.ops import cascade_attention as ca
from prism.ops import kv_write as kw
from prism.ops import paged_attention as pa
from prism.ops.attention_metadata import PagedAttentionMetadata, SharedPrefix
from prism.ops.dispatch import KERNELS_ENV
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TRITON_OK = kw.HAVE_TRITON and (kw._INTERPRETED or torch.cuda.is_available())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1 at import")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

PAGE = 4
LEADER_PAGES = [10, 11, 12, 13, 14, 15]
# (pages, context): prefixes of the leader's pages of several lengths, a row whose new token sits on a shared
# page's successor, an unrelated row, a one-token row (a graph's padding), a row sharing all six pages.
ROWS = [
    (LEADER_PAGES[:5] + [20], 21),
    (LEADER_PAGES[:3] + [21, 22], 15),
    (LEADER_PAGES[:6] + [23], 25),
    ([30, 31, 32], 10),
    ([40], 1),
    (LEADER_PAGES[:6] + [24, 25], 30),
]


def plan(rows):
    tables = [t for t, _ in rows]
    return ca.plan_shared_prefix(page_table(tables, max(map(len, tables))), np.array([c for _, c in rows]), PAGE)


def test_plan_takes_the_longest_of_the_most_shared_first_pages_and_cuts_before_each_new_token():
    leader, prefix = plan(ROWS)
    assert leader == 5  # of the rows starting on page 10, the one with the most full pages (7)
    # row 0: 5 shared pages, its new token (position 20) on page 5; row 1: 3 pages; row 2: 6, its new token on
    # its 7th; the leader: the 6 pages row 2 shares (its 7th, page 24, is its own)
    assert prefix.tolist() == [20, 12, 24, 0, 0, 24]


def test_plan_needs_two_rows():
    assert plan([ROWS[0], ROWS[3], ROWS[4]])[1].tolist() == [0, 0, 0]
    assert plan([(LEADER_PAGES[:2], 5), (LEADER_PAGES[:2], 8)])[1].tolist() == [4, 4]  # ctx 5: 1 full page
    assert plan([(LEADER_PAGES[:1], 4), (LEADER_PAGES[:1], 3)])[1].tolist() == [0, 0]  # no full page before


def test_plan_over_the_rows_of_one_question():
    """A short prefill's tokens are rows of one table (page 0 a real page), each cut below its own token's page."""
    leader, prefix = plan([([0, 1, 2], 8), ([0, 1, 2], 9), ([0, 1, 2], 12), ([0, 1, 2], 1)])
    assert prefix.tolist() == [4, 8, 8, 0] and leader in (1, 2)
    # the leader (row 1, three full pages) keeps only the two that row 2 shares
    leader, prefix = plan([([5, 6], 8), ([5, 6, 7, 9], 16), ([5, 6, 8], 10)])
    assert leader == 1 and prefix.tolist() == [4, 8, 8]


def test_plan_skips_a_pass_that_spares_little():
    """One shared page of two 4-page contexts spares 12.5% of the key reads: below MIN_SAVED_FRACTION."""
    assert plan([([5, 1, 2, 3], 16), ([5, 7, 8, 9], 16)])[1].tolist() == [0, 0]
    assert plan([([5, 6, 2, 3], 16), ([5, 6, 8, 9], 16)])[1].tolist() == [8, 8]  # 2 of 8 pages: 25%


def test_plan_leader_spares_the_most_not_the_longest():
    """31 rows share 8 pages; a longer row shares only the first: the leader is one of the 31."""
    rows = [(list(range(10, 18)) + [100 + i], 8 * PAGE + 1) for i in range(31)]
    rows.append(([10] + list(range(200, 220)), 21 * PAGE))
    leader, prefix = plan(rows)
    assert leader < 31 and prefix.tolist() == [8 * PAGE] * 31 + [PAGE]


def _pool_and_meta(kv_dtype: str, group: int, seed: int):
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=PAGE, num_pages=48, kv_dtype=kv_dtype)
    pool = KVPool.allocate(lay, DEV)
    g = torch.Generator().manual_seed(seed)
    pages = sorted({p for t, _ in ROWS for p in t})
    slots = torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])
    k = torch.randn(len(slots), 2, 16, generator=g) * torch.logspace(-1, 1, 16)
    v = torch.randn(len(slots), 2, 16, generator=g)
    kw.write_kv_reference(pool, 0, slots.to(DEV), k.to(DEV), v.to(DEV))
    meta = PagedAttentionMetadata.build([1] * len(ROWS), [c for _, c in ROWS], [t for t, _ in ROWS], PAGE, DEV)
    leader, prefix = plan(ROWS)
    shared = SharedPrefix(torch.tensor(prefix, device=DEV), torch.tensor([leader], device=DEV), 3)
    q = torch.randn(len(ROWS), 2 * group, 16, generator=g).to(DEV)
    return pool, meta, dataclasses.replace(meta, shared_prefix=shared), q


@needs_triton
@pytest.mark.parametrize("tail_splits", [1, 2])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16", "fp32"])
def test_cascade_matches_the_reference(kv_dtype, group, tail_splits):
    pool, meta, cascade, q = _pool_and_meta(kv_dtype, group, seed=group)
    for q_dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        want = pa.paged_attention_reference(q.to(q_dtype).float(), pool, 0, meta)
        got = pa.paged_decode_attention(q.to(q_dtype), pool, 0, cascade, use_triton=True, num_splits=tail_splits)
        assert got.dtype == q_dtype
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


@needs_triton
def test_cascade_over_several_row_blocks(monkeypatch):
    """More (sequence, head) rows than one program holds: each row block finds its own longest prefix."""
    monkeypatch.setattr(ca, "BLOCK_M", 16)
    pool, meta, cascade, q = _pool_and_meta("fp8", 4, seed=7)  # 6 x 4 rows of each KV head: 2 blocks
    want = pa.paged_attention_reference(q, pool, 0, meta)
    torch.testing.assert_close(pa.paged_decode_attention(q, pool, 0, cascade, use_triton=True), want,
                               atol=1e-5, rtol=0)


@needs_triton
@pytest.mark.parametrize("tail_splits,shared_splits", [(1, 1), (4, 3), (3, 16)])
def test_cascade_with_several_working_splits(monkeypatch, tail_splits, shared_splits):
    """16-key tiles over contexts of up to 118 keys, so later splits of both passes read keys (the default
    128-key tiles would leave every split but the first empty at these sizes). From review."""
    monkeypatch.setattr(pa, "_BLOCK_N", 16)
    monkeypatch.setattr(ca, "BLOCK_N", 16)
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=PAGE, num_pages=80, kv_dtype="fp8")
    pool = KVPool.allocate(lay, DEV)
    g = torch.Generator().manual_seed(0)
    slots = torch.arange(lay.num_slots)
    kw.write_kv_reference(pool, 0, slots.to(DEV), (torch.randn(len(slots), 2, 16, generator=g) * 3).to(DEV),
                          torch.randn(len(slots), 2, 16, generator=g).to(DEV))
    run = list(range(1, 21))  # 20 pages, 80 keys
    rows = [(run + [30, 31, 32, 33, 34, 35], 20 * PAGE + 22), (run[:13] + [40, 41], 13 * PAGE + 6),
            (run + list(range(50, 60)), 20 * PAGE + 38), (list(range(60, 69)), 33), ([70], 1)]
    leader, prefix = plan(rows)
    assert prefix.tolist() == [80, 52, 80, 0, 0] and leader in (0, 2)
    meta = PagedAttentionMetadata.build([1] * len(rows), [c for _, c in rows], [t for t, _ in rows], PAGE, DEV)
    cascade = dataclasses.replace(meta, shared_prefix=SharedPrefix(
        torch.tensor(prefix, device=DEV), torch.tensor([leader], device=DEV), shared_splits))
    q = torch.randn(len(rows), 4, 16, generator=g).to(DEV)
    want = pa.paged_attention_reference(q, pool, 0, meta)
    got = pa.paged_decode_attention(q, pool, 0, cascade, use_triton=True, num_splits=tail_splits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shared_prefix_metadata_is_checked():
    meta = PagedAttentionMetadata.build([1, 1], [5, 6], [[0, 1], [0, 2]], PAGE)
    good = SharedPrefix(torch.tensor([4, 4]), torch.tensor([0]), 2)
    dataclasses.replace(meta, shared_prefix=good)
    for bad, msg in ((dataclasses.replace(good, prefix_lens=torch.tensor([4])), "prefix_lens"),
                     (dataclasses.replace(good, leader=torch.tensor([0], dtype=torch.int32)), "leader"),
                     (dataclasses.replace(good, splits=0), "splits")):
        with pytest.raises(ValueError, match=msg):
            dataclasses.replace(meta, shared_prefix=bad)
    prefill = PagedAttentionMetadata.build([2, 1], [5, 6], [[0, 1], [0, 2]], PAGE)
    with pytest.raises(ValueError, match="decode steps only"):
        dataclasses.replace(prefill, shared_prefix=good)
    with pytest.raises(ValueError, match="shared prefix"):  # the shared pass without a shared prefix
        pool = KVPool.allocate(KVLayout(1, 2, 16, PAGE, 4, "fp8"), "cpu")
        ca.launch_shared_prefix_pass(torch.zeros(2, 2, 16), pool.payload, pool.scales, pool, 0, meta, 1, 1.0,
                                     torch.zeros(1), torch.zeros(1), first_slot=1, common={})


# ------------------------------------------------------------------------------------------------ engine

IMAGE = random_images([(32, 32)], seed=5)[0]


def _generate(monkeypatch, kernels: str, cascade_min_batch: int):
    monkeypatch.setenv(KERNELS_ENV, kernels)
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=4, num_gpu_pages=96, check_invariants=True,
              graph_rows_without_cuda=True, cascade_attention_min_batch=cascade_min_batch)
    prompts = [[{"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": t}]}]
               for t in ("One?", "Two, longer?", "3")]
    llm.generate(prompts[:1], SamplingParams.greedy(max_tokens=1))  # the image prefix cached
    out = llm.generate(prompts, SamplingParams.greedy(max_tokens=3, ignore_eos=True, logprobs=2))
    return out, llm.engine.runner.graphs.shared_prefix_steps


@pytest.mark.skipif(torch.cuda.is_available() or not kw.HAVE_TRITON, reason="the CPU interpreter run")
def test_engine_decodes_with_cascade_attention_like_the_reference(monkeypatch):
    reference, _ = _generate(monkeypatch, "reference", 0)
    cascade, shared_steps = _generate(monkeypatch, "triton", 2)
    assert shared_steps > 0, "no decode step shared the image prefix"
    for ref, got in zip(reference, cascade, strict=True):
        assert got.error is None and got.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, got.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_cascade_matches_the_reference_8b_shape(kv_dtype):
    """W3 batch 32's shape: 32 sequences over the same 6 pages of 256 tokens, then a page of their own (contexts
    of 1,600 to 1,700), beside 4 sequences on pages of their own; 8 KV heads, 32 query heads of 128."""
    lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, page_size=256, num_pages=48, kv_dtype=kv_dtype)
    pool = KVPool.allocate(lay, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    slots = torch.arange(lay.num_slots, device="cuda")
    for layer in range(2):
        kw.write_kv(pool, layer, slots, torch.randn(lay.num_slots, 8, 128, device="cuda", generator=g,
                                                    dtype=torch.bfloat16) * 4,
                    torch.randn(lay.num_slots, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16))
    tables = [[0, 1, 2, 3, 4, 5, 6 + i] for i in range(32)] + [[40 + i, 44 + i] for i in range(4)]
    contexts = [1537 + 5 * i for i in range(32)] + [300, 257, 511, 400]
    meta = PagedAttentionMetadata.build([1] * len(tables), contexts, tables, 256, "cuda")
    leader, prefix = ca.plan_shared_prefix(page_table(tables, 7), np.array(contexts), 256)
    assert prefix.tolist() == [1536] * 32 + [0] * 4
    for splits in (4, 16):
        cascade = dataclasses.replace(meta, shared_prefix=SharedPrefix(
            torch.tensor(prefix, device="cuda"), torch.tensor([leader], device="cuda"), splits))
        # fp32: 17 partial softmaxes merged over 1,700 keys of values up to ~4 sigma (H200: 1.03e-5 at most)
        for q_dtype, tol, rtol in ((torch.float32, 3e-5, 0.0), (torch.bfloat16, 1e-2, 2**-8)):
            q = torch.randn(len(tables), 32, 128, device="cuda", generator=g).to(q_dtype)
            for layer in range(2):
                want = pa.paged_attention_reference(q.float(), pool, layer, meta)
                got = pa.paged_decode_attention(q, pool, layer, cascade)
                torch.testing.assert_close(got.float(), want, atol=tol, rtol=rtol)


def test_plan_check_catches_bad_plans():
    """`check_shared_prefix_plan` (run on every plan under check_invariants) against hand-made bad plans."""
    tables = [t for t, _ in ROWS]
    table, ctx = page_table(tables, 8), np.array([c for _, c in ROWS])
    leader, prefix = plan(ROWS)
    ca.check_shared_prefix_plan(table, ctx, PAGE, leader, prefix)
    ca.check_shared_prefix_plan(table, ctx, PAGE, 0, np.zeros(len(ROWS), dtype=np.int64))
    bad = {"whole pages": prefix + 1, "new tokens": np.where(np.arange(len(ROWS)) == 0, 24, prefix),
           "does not hold": np.where(np.arange(len(ROWS)) == 3, 4, prefix)}
    for msg, wrong in bad.items():
        with pytest.raises(ValueError, match=msg):
            ca.check_shared_prefix_plan(table, ctx, PAGE, leader, wrong)
    with pytest.raises(ValueError, match="leader"):
        ca.check_shared_prefix_plan(table, ctx, PAGE, len(ROWS), prefix)
