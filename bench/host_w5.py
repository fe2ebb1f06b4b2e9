"""Host time of W5 with the model stubbed out (CPU machine; not part of `nox -s bench`).

W5's shape on the tiny checkpoint: 32 clients over 32 groups of four 448x448 images (Zipf 1.1), 256 requests of 16
tokens, their inputs prepared by 8 threads beside the engine loop, page size 256 and the 8B's pool sizes at the
benchmark's 3 GiB budget (165 pages with scaled-FP8 KV, 85 with BF16). The decoder's forwards (graph rows, packed
steps, eager) and the vision encoder return zeros, so what remains is the host's work: preparation (pixels, digests,
cache lookups), scheduling and prefix lookups, step payloads and graph inputs, sampling and commits. On the H200
FP8's W5 is host-bound (63-79 req/s over three machines, session 14): this measures that part alone, counts the
steps launched while another was in flight (async scheduling, async admissions on and off), and profiles the engine
loop's thread (cProfile, sorted by the first argument, default cumulative). On the CPU the stubbed
device work still allocates its zeros, and pageable copies cost no stream sync.

    PYTHONPATH=src python bench/host_w5.py [sort key] [requests, default 256]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import bench_workloads  # noqa: E402
from model_stubs import stub_graph_forwards  # noqa: E402

from prism.engine import runner as runner_module  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

POOL_PAGES = {"fp8": 165, "bf16": 85}  # the 8B's pages at W5's 3 GiB budget (page size 256)


def stub_the_model(vocab: int, hidden: int, levels: int, merge: int) -> None:
    """Every forward returns zero logits, the vision encoder zero features of the right shapes."""
    stub_graph_forwards(vocab)
    runner_module.ModelRunner._forward = lambda self, forward, features, token_ids=None: torch.zeros(
        sum(p.sample for p in forward.pieces), vocab)

    def encode(model, grids, pixels, group, **kwargs):
        tokens = [int(t) * int(h) * int(w) // merge**2 for t, h, w in grids]
        return [(torch.zeros(n, hidden), torch.zeros(levels, n, hidden)) for n in tokens]

    runner_module.encode_media_items = encode


def main() -> None:
    sort = sys.argv[1] if len(sys.argv) > 1 else "cumulative"
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    ckpt = ensure_tiny_checkpoint()
    probe = bench_workloads.LLM(ckpt).engine.runner.model.config
    stub_the_model(probe.text.vocab_size, probe.text.hidden_size, len(probe.vision.deepstack_visual_indexes),
                   probe.vision.spatial_merge_size)
    for kv_dtype, admissions in (("fp8", True), ("fp8", False), ("bf16", True)):
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        result = bench_workloads.w5_working_set(ckpt, kv_dtype, 3 * 2**30, 448, 32, 32, requests,
                                                num_gpu_pages=POOL_PAGES[kv_dtype], graph_rows_without_cuda=True,
                                                async_admissions=admissions)
        profiler.disable()
        wall = time.perf_counter() - start
        print(f"{kv_dtype}{'' if admissions else ' without async admissions'}: {result['req_per_s']:.1f} req/s host only "
              f"({wall:.1f} s with the engine's construction), hit rate {result['hit_rate']:.1%}, evictions "
              f"{result['evictions']}, TTFT p50 {result['ttft_p50_ms']:.1f} ms; engine steps {result['steps']}, of which "
              f"launched ahead {result['async_steps']} (scheduled ahead {result['scheduled_ahead_steps']})")
        if kv_dtype == "fp8" and admissions:
            pstats.Stats(profiler).sort_stats(sort).print_stats(25)


if __name__ == "__main__":
    main()
