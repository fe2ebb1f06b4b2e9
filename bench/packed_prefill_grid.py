"""What the packed CUDA graphs' fixed prefill grid costs (not part of `nox -s bench`).

A packed graph launches the prefill kernel over a grid sized for its bucket (`PackedGraphs.num_blocks`: every
piece may add a partial block) with the bucket's fixed key splits, whatever the step holds. W2's question (30
tokens over 1,630 cached ones, plus the 2-token padding piece of bucket 32) fills 3 of those blocks. This
times, inside a CUDA graph, that step's launch over the grid it needs and over the grids of buckets 32 and
64, at 8 and 16 splits: the difference is what the empty blocks and extra splits cost per layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_timing import random_fp8_pool, us_per_call_in_graph  # noqa: E402

from prism.kv.fp8 import KVLayout  # noqa: E402
from prism.ops import paged_prefill as pp  # noqa: E402
from prism.ops.attention_metadata import PagedAttentionMetadata  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/packed_prefill_grid.txt")
    args = parser.parse_args()
    pool = random_fp8_pool(KVLayout(36, HKV, D, PAGE, 16, "fp8"))
    question, context, padding = 30, 1630, 2
    query_lens, context_lens = [question, padding], [context, padding]
    tables = [list(range(-(-context // PAGE))), [15]]
    meta = PagedAttentionMetadata.build(query_lens, context_lens, tables, PAGE, "cuda")
    q = torch.randn(question + padding, HQ, D, dtype=torch.bfloat16, device="cuda")
    tokens = pp.tokens_per_block(HQ // HKV)
    real = pp.prefill_blocks(query_lens, context_lens, tokens).cuda()
    lines = [f"W2 step: {real.shape[0]} real blocks of <= {tokens} tokens; us per layer (launch in a CUDA graph)"]
    for bucket in (None, 32, 64):
        grid = real.shape[0] if bucket is None else -(-bucket // tokens) + min(65, bucket)
        blocks = torch.zeros((grid, 4), dtype=torch.int64, device="cuda")
        blocks[: real.shape[0]] = real
        launch = pp.PrefillLaunch.static(HQ // HKV, blocks)
        for splits in (8, 16):
            us = us_per_call_in_graph(lambda launch=launch, splits=splits: pp.paged_prefill_attention(
                q, pool, 3, meta, launch=launch, num_splits=splits, use_triton=True))
            label = "exact grid" if bucket is None else f"bucket {bucket} grid"
            lines.append(f"  {label:15s} ({grid:3d} blocks) splits {splits:2d}: {us:6.1f} us")
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
