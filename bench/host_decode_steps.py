"""Host time of Prism's decode steps with the model stubbed out (CPU machine; not part of `nox -s bench`).

The tiny checkpoint, `batch` requests over the same 8 images (page size 256, as the 8B benchmarks), prefilled with
the real model; then the graph rows' forward is replaced by one returning zero logits, so a step costs only its
scheduling, payload, graph-input and commit work: what the GPU waits for between two replays. Prints the mean host
time per step and a cProfile of 30 steps.

    PYTHONPATH=src python bench/host_decode_steps.py 32
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from model_stubs import stub_graph_forwards  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=256, max_num_seqs=64, graph_rows_without_cuda=True)
    engine = llm.engine
    vocab = engine.runner.model.config.text.vocab_size
    images = random_images([(448, 448)] * 8, seed=7)
    for i in range(batch):
        content = [*({"type": "image", "image": im} for im in images), {"type": "text", "text": f"question {i}?"}]
        engine.add_request(f"r{i}", engine.inputs.prepare_chat([{"role": "user", "content": content}]),
                           SamplingParams.greedy(max_tokens=200, ignore_eos=True))
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()  # the prefills, through the real model
    stub_graph_forwards(vocab)
    steps = 50
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    print(f"batch {batch}: host time per decode step {(time.perf_counter() - start) / steps * 1e3:.3f} ms")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(30):
        engine.step()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
