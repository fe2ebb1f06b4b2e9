"""Sweep the paged prefill-attention kernel's launch knobs on the GPU (not part of `nox -s bench`).

8B shapes (32 query heads, 8 KV heads of 128), scaled-FP8 pages of 256 tokens:
- w1: one sequence prefilled from scratch, 1,600 tokens (W1's eight images);
- chunk256: 256 new tokens of one sequence at positions 1,024-1,279 (W4's interleaved chunks);
- w2: a 30-token question after a 1,600-token cached prefix (W2 when it runs eagerly, W7's branches).
For each case and each (rows per program, keys per tile, pipeline stages, warps, splits) the kernel is
captured 20 times in a CUDA graph and the replay timed. Prints the best configurations per case and the
current defaults' time; writes the table to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_timing import random_fp8_pool, sweep_knobs, us_per_call_in_graph  # noqa: E402

from prism.kv.fp8 import KVLayout  # noqa: E402
from prism.ops import paged_prefill as pp  # noqa: E402
from prism.ops.attention_metadata import PagedAttentionMetadata  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 256
CASES = {"w1": (1600, 1600), "chunk256": (256, 1280), "w2": (30, 1630)}  # (new tokens, context after)


def time_config(q, pool, meta, splits: int) -> float:
    launch = pp.PrefillLaunch(meta.query_lens, meta.context_lens_host, HQ // HKV, pool.device)

    def call():
        pp.paged_prefill_attention(q, pool, 3, meta, launch=launch, num_splits=splits, use_triton=True)

    return us_per_call_in_graph(call)


# --focused: around the current defaults, with the V load issued beside the K load (`V_WITH_K`).
FULL = {"_BLOCK_ROWS": (64, 128), "_BLOCK_N": (64, 128), "_NUM_STAGES": (1, 2), "_NUM_WARPS": (4, 8),
        "_V_WITH_K": (False,)}
FOCUSED = {"_BLOCK_ROWS": (64,), "_BLOCK_N": (128,), "_NUM_STAGES": (1, 2), "_NUM_WARPS": (4, 8),
           "_V_WITH_K": (False, True)}
# --schedule: the launch order and the unmasked leading tiles (`paged_prefill._HEAVIEST_FIRST`, `_HEADS_FASTEST`,
# `_SPLIT_MASKED`) each on and off at the current tiles, then the tiles again with all three on.
SCHEDULE = {"_HEAVIEST_FIRST": (False, True), "_HEADS_FASTEST": (False, True), "_SPLIT_MASKED": (False, True)}
SCHEDULED_TILES = {"_BLOCK_ROWS": (64, 128), "_NUM_STAGES": (1, 2), "_NUM_WARPS": (4, 8)}
SPLITS = {"full": {"w1": (1,), "chunk256": (1, 2), "w2": (4, 8, 16)},
          "focused": {"w1": (1,), "chunk256": (1, 2), "w2": (8, 16)},
          "schedule": {"w1": (1,), "chunk256": (1,), "w2": (8,)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/tune_prefill_attention.txt")
    parser.add_argument("--focused", action="store_true", help="the narrower grid with V_WITH_K (see FOCUSED)")
    parser.add_argument("--schedule", action="store_true", help="the launch order and mask split (see SCHEDULE)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    args = parser.parse_args()
    if args.schedule:
        sweeps, splits = [SCHEDULE, SCHEDULED_TILES], SPLITS["schedule"]
    else:
        sweeps, splits = [FOCUSED if args.focused else FULL], SPLITS["focused" if args.focused else "full"]
    pool = random_fp8_pool(KVLayout(36, HKV, D, PAGE, 16, "fp8"))
    lines = []
    for name in args.cases.split(","):
        new, ctx = CASES[name]
        meta = PagedAttentionMetadata.build([new], [ctx], [list(range(-(-ctx // PAGE)))], PAGE, "cuda")
        q = torch.randn(new, HQ, D, dtype=torch.bfloat16, device="cuda")
        blocks = -(-new // (pp._BLOCK_ROWS // (HQ // HKV)))
        default_splits = pp.prefill_num_splits(new, blocks, HQ, HKV, D, ctx)
        for knobs in sweeps:
            report = sweep_knobs(pp, knobs, splits[name], default_splits,
                                 lambda n, q=q, meta=meta: time_config(q, pool, meta, n),
                                 f"{name} ({new} new tokens, context {ctx})")
            lines += report
            print("\n".join(report), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
