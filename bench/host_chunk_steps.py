"""Host time of Prism's interleaved chunk steps with the model stubbed out (CPU machine; not part of `nox -s bench`).

W4's interleaved shape on the tiny checkpoint: 8 requests decoding, then a cold request with 8 images of 448x448
(page size 256, `interleave_prefill_tokens`, as the 8B benchmark) whose prompt is prefilled in chunks of ~600 tokens
beside the decodes. The decoder's forwards (graph rows and packed steps) are replaced by ones returning zero
logits once the decodes run, so a step costs only its scheduling, payload, graph-input, media placement and commit
work: on the GPU, what the device waits for between two chunk steps, since a chunk step is only prepared once the
step before it has returned its tokens. Prints the host time of each step from the one after its images were
encoded ahead (with one rank on the CPU there is no side stream: it is admitted at once) to its first token, then
a cProfile of those steps (sorted by the second argument, default cumulative). On the CPU the device ops (the media
features' concatenation and copies) count as host time, and pageable copies cost no stream sync: on CUDA both differ.

    PYTHONPATH=src python bench/host_chunk_steps.py [interleave tokens, default 640]
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
    interleave = int(sys.argv[1]) if len(sys.argv) > 1 else 640
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=256, max_num_seqs=16, num_gpu_pages=64,
              interleave_prefill_tokens=interleave, graph_rows_without_cuda=True)
    engine = llm.engine
    vocab = engine.runner.model.config.text.vocab_size
    for i in range(8):
        engine.add_request(f"long{i}", f"Tell a very long story, number {i}.",
                           SamplingParams.greedy(max_tokens=400, ignore_eos=True))
    while any(not r.output_token_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prefills, through the real model
    stub_graph_forwards(vocab)
    content = [*({"type": "image", "image": im} for im in random_images([(448, 448)] * 8, seed=5)),
               {"type": "text", "text": "Describe all."}]
    cold = engine.add_request("cold", engine.inputs.prepare_chat([{"role": "user", "content": content}]),
                              SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    while not engine.runner.is_encoder_cached(cold.prompt.media[0].digest):
        engine.step()  # its images encoded ahead (the real vision encoder)
    profiler = cProfile.Profile()
    rows = []
    while not cold.output_token_ids:
        before = engine.runner.stats.tokens_computed
        start = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        rows.append(((time.perf_counter() - start) * 1e3, engine.runner.stats.tokens_computed - before))
    for ms, tokens in rows:
        print(f"step: {tokens:4d} tokens, host {ms:6.2f} ms")
    pstats.Stats(profiler).sort_stats(sys.argv[2] if len(sys.argv) > 2 else "cumulative").print_stats(30)


if __name__ == "__main__":
    main()
