"""Sweep the decode-attention kernel's launch knobs on the GPU (not part of `nox -s bench`).

8B shapes (32 query heads, 8 KV heads of 128), scaled-FP8 pages of 256 tokens, contexts of 1,700 tokens:
- b1: one sequence (W3 batch 1);
- rows16: 16 rows of ONE sequence at consecutive positions (a 16-token question after a prefix hit, run
  as graph rows: W2);
- b32: 32 sequences (W3 batch 32) on their own pages;
- b32shared: 32 sequences sharing their first 6 pages (W3 batch 32 as benchmarked: the same 8 images, then
  each its own question and answer on its own last page), so most K/V reads hit the L2 cache.
For each case and each (keys per tile, pipeline stages, warps, splits) the kernel is captured 20 times in
a CUDA graph and the replay timed, so launch overhead does not hide the kernel. Prints the best
configurations per case and the current defaults' time; writes the table to --out.

--cascade: cascade attention (`ops/cascade_attention.py`) on b32shared, b8shared (8 sequences) and b32 (nothing
shared: the cost of the empty shared pass), its shared pass's knobs swept, beside the plain kernel's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_timing import random_fp8_pool, sweep_knobs, us_per_call_in_graph  # noqa: E402

from prism.kv.fp8 import KVLayout, KVPool  # noqa: E402
from prism.ops import cascade_attention as ca  # noqa: E402
from prism.ops import paged_attention as pa  # noqa: E402
from prism.ops.attention_metadata import PagedAttentionMetadata, SharedPrefix  # noqa: E402
from prism.ops.paged_attention import paged_decode_attention  # noqa: E402

HQ, HKV, D, PAGE, CTX = 32, 8, 128, 256, 1700


def case(name: str, pool: KVPool):
    pages_per_seq = -(-CTX // PAGE)
    if name == "b1":
        tables, ctx = [list(range(pages_per_seq))], [CTX]
    elif name == "rows16":
        tables, ctx = [list(range(pages_per_seq))] * 16, [CTX - 15 + i for i in range(16)]
    elif name in ("b32shared", "b8shared"):
        n = 32 if name == "b32shared" else 8
        shared = list(range(pages_per_seq - 1))
        tables = [shared + [pages_per_seq - 1 + i] for i in range(n)]
        ctx = [CTX] * n
    else:
        tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(32)]
        ctx = [CTX] * 32
    n = len(ctx)
    width = 32768 // PAGE  # the graphs' host facts: every row may reach the longest context
    tables = [t + [0] * (width - len(t)) for t in tables]
    meta = PagedAttentionMetadata(
        torch.arange(n + 1, device="cuda"), torch.tensor(ctx, device="cuda"),
        torch.tensor(tables, device="cuda"), torch.arange(n, device="cuda"),
        (1,) * n, (32768,) * n, PAGE, pool.layout.num_pages - 1)
    q = torch.randn(n, HQ, D, dtype=torch.bfloat16, device="cuda")
    return q, meta


def with_shared_prefix(meta: PagedAttentionMetadata, splits: int) -> PagedAttentionMetadata:
    """`meta` with the shared prefix the CUDA graphs' rows would plan for it."""
    table = meta.block_table.cpu().numpy()
    leader, prefix = ca.plan_shared_prefix(table, np.array(meta.context_lens.tolist()), PAGE)
    shared = SharedPrefix(torch.tensor(prefix, device="cuda"), torch.tensor([leader], device="cuda"), splits)
    return dataclasses.replace(meta, shared_prefix=shared)


def time_config(q, pool, meta, splits: int) -> float:
    def call():
        paged_decode_attention(q, pool, 3, meta, num_splits=splits, use_triton=True)

    return us_per_call_in_graph(call)


# --focused: the knobs session 3's full sweep left open, with the V load issued beside the K load or after the
# scores (`_attend_keys`'s V_WITH_K); splits around each case's best.
FULL = {"_BLOCK_N": (32, 64, 128), "_NUM_STAGES": (1, 3), "_NUM_WARPS": (4, 8), "_V_WITH_K": (False,)}
FOCUSED = {"_BLOCK_N": (128,), "_NUM_STAGES": (1, 2, 3), "_NUM_WARPS": (4, 8), "_V_WITH_K": (False, True)}
SPLITS = {"full": dict.fromkeys(("b1", "rows16", "b32"), (1, 2, 4, 8, 16, 32, 64)),
          "focused": {"b1": (16, 32), "rows16": (2, 4), "b32": (1, 2)}}
# --shared: batch 32 over a shared prefix, where the kernel waits on latency rather than on HBM: more programs
# (splits, fewer warps each) may hide it.
SHARED = {"_BLOCK_N": (64, 128), "_NUM_STAGES": (1, 2), "_NUM_WARPS": (2, 4, 8), "_V_WITH_K": (True,)}
# --cascade: the shared pass's knobs; "splits" are its programs per row block (SharedPrefix.splits).
CASCADE = {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "NUM_WARPS": (4, 8)}


def cascade_sweep(pool: KVPool) -> list[str]:
    lines = []
    for name in ("b32shared", "b8shared", "b32"):
        q, meta = case(name, pool)
        plain = time_config(q, pool, meta, pa.decode_num_splits(len(meta.query_lens), HKV, 32768))
        lines.append(f"== {name}: plain decode kernel (defaults) {plain:.1f} us")

        def time_cascade(splits, q=q, meta=meta):
            cascade = with_shared_prefix(meta, splits)
            return us_per_call_in_graph(lambda: paged_decode_attention(q, pool, 3, cascade, use_triton=True))

        lines += sweep_knobs(ca, CASCADE, (4, 8, 16), ca.SPLITS, time_cascade, f"{name} cascade")
        print("\n".join(lines[-13:]), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/tune_decode_attention.txt")
    parser.add_argument("--focused", action="store_true", help="the narrower grid with V_WITH_K (see FOCUSED)")
    parser.add_argument("--shared", action="store_true", help="only batch 32 over a shared prefix (see SHARED)")
    parser.add_argument("--cascade", action="store_true", help="cascade attention's shared pass (see CASCADE)")
    args = parser.parse_args()
    knobs, splits = (FOCUSED, SPLITS["focused"]) if args.focused else (FULL, SPLITS["full"])
    cases = ("b1", "rows16", "b32")
    if args.shared:
        knobs, splits, cases = SHARED, {"b32shared": (1, 2, 4, 8)}, ("b32shared",)
    pool = random_fp8_pool(KVLayout(36, HKV, D, PAGE, 32 * 7 + 8, "fp8"))
    lines = cascade_sweep(pool) if args.cascade else []
    if args.cascade:
        cases = ()
    for name in cases:
        q, meta = case(name, pool)
        default_splits = pa.decode_num_splits(len(meta.query_lens), HKV, 32768)
        report = sweep_knobs(pa, knobs, splits[name], default_splits,
                             lambda n, q=q, meta=meta: time_config(q, pool, meta, n), name)
        lines += report
        print("\n".join(report), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
