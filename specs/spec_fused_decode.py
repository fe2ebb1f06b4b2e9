"""Spec of the fused decode attention (`ops/fused_decode.py`): one launch per layer for the Q/K norm + rope, the
K/V write, the split attention and the merge, with exactly the results of the unfused launches.

For any decode batch (contexts from one key to several splits of several pages; the new token first in its page,
in its split, or anywhere), any pool kind, GQA group and split count, through the Triton interpreter:
1. the attention output is bitwise that of `qk_norm_rope_write_kv` then `paged_decode_attention`;
2. the pool's bytes are bitwise theirs (the new token's K/V quantized as the write kernel quantizes them, nothing
   else touched);
3. the arrival counters are all back at zero (the next launch counts from zero).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.kv.fp8 import KVLayout, KVPool
from prism.ops import fused_decode
from prism.ops import kv_write as kw
from prism.ops import paged_attention as pa
from prism.ops.attention_metadata import PagedAttentionMetadata
from prism.ops.qk_norm_rope_kv import qk_norm_rope_write_kv
from prism.testing.knobs import module_knobs

PAGE = 4
NUM_PAGES = 64
HKV, D = 2, 16
BLOCK_N = 16  # the smallest tl.dot tile: contexts of up to 48 keys span several splits
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def decode_step(contexts: list[int], kv_dtype: str, dtype: torch.dtype, group: int, seed: int):
    """A pool whose every slot holds random K/V, one row per context on pages of its own, and the rows' q/k/v before
    their norm and rope (views of one qkv output, as the decoder makes them)."""
    lay = KVLayout(num_layers=2, num_kv_heads=HKV, head_dim=D, page_size=PAGE, num_pages=NUM_PAGES, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(seed)
    pools = [KVPool.allocate(lay, "cpu") for _ in range(2)]
    slots = torch.arange(lay.num_slots)
    k_all, v_all = torch.randn(len(slots), HKV, D, generator=g) * 3, torch.randn(len(slots), HKV, D, generator=g)
    for pool in pools:
        kw.write_kv_reference(pool, 1, slots, k_all, v_all)
    pages = iter(torch.randperm(NUM_PAGES, generator=g).tolist())
    tables = [[next(pages) for _ in range(-(-c // PAGE))] for c in contexts]
    meta = PagedAttentionMetadata.build([1] * len(contexts), contexts, tables, PAGE)
    n, hq = len(contexts), HKV * group
    qkv = (torch.randn(n, (hq + 2 * HKV) * D, generator=g) * 3).to(dtype)
    q, k, v = qkv.split([hq * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(n, hq, D), k.view(n, HKV, D), v.view(n, HKV, D)
    qw, kw_ = ((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2))
    angles = torch.rand(n, D // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return pools, meta, (q, k, v, qw, kw_, 1e-6, cos, sin)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 48), min_size=1, max_size=4), st.sampled_from(["fp8", "bf16", "fp32"]),
       st.sampled_from([torch.float32, torch.float16]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]),
       st.integers(0, 2**16))
def spec_fused_decode_equals_the_unfused_launches(contexts, kv_dtype, dtype, group, splits, seed) -> None:
    (want_pool, got_pool), meta, args = decode_step(contexts, kv_dtype, dtype, group, seed)
    q, k, v, qw, kw_, eps, cos, sin = args
    with module_knobs(pa, {"_BLOCK_N": BLOCK_N}):
        rotated = qk_norm_rope_write_kv(q, k, v, qw, kw_, eps, cos, sin, want_pool, 1, meta.slot_mapping)
        want = pa.paged_decode_attention(rotated, want_pool, 1, meta, use_triton=True, num_splits=splits)
        got = fused_decode.qk_norm_rope_decode_attention(*args, got_pool, 1, meta, num_splits=splits)
    assert got is not None, "the fused launch declined a decode step it should take"
    assert torch.equal(got_pool.payload_bits(), want_pool.payload_bits()), "the pool's bytes differ"
    assert got_pool.scales is None or torch.equal(got_pool.scales, want_pool.scales), "the pool's scales differ"
    err = float((got.float() - want.float()).abs().max())
    assert torch.equal(got, want), f"the fused attention differs from the unfused launches by {err}"
    counters = fused_decode._COUNTERS.get(torch.device("cpu"))
    assert counters is None or not counters.any(), f"arrival counters left at {counters.nonzero().flatten().tolist()}"
