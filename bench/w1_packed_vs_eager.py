"""W1's cold step (vision + the 1,598-token prefill) replayed as a packed CUDA graph vs run eagerly (not part of
`nox -s bench`). One engine with packed graphs up to 2,048 tokens and a 1,792-token bucket (added here: the default
buckets jump from 1,536 to 2,048); the two modes alternate request by request by moving the packed graphs' token
limit, each on 8 new 448x448 images; the first request of each mode is a warm-up.

Session 5 (H200): packed 69.3 ms vs eager 67.1 ms median (bench/results/*-w1-packed-vs-eager.txt): the eager step is
GPU-bound, and 194 padding tokens cost more than the host work the graph saves. The default limit stays 1,024.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from prism.engine import packed_graphs  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def chat(images, question: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": question}]}]


def main() -> None:
    ckpt = Path("/tmp/prism-bench/qwen3vl-8b-random")
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=False)
    packed_graphs.BUCKETS = (*packed_graphs.BUCKETS[:-1], 1792, 2048)
    llm = LLM(ckpt, kv_dtype="fp8", kv_memory_bytes=16 * 2**30, page_size=256, max_num_seqs=64,
              max_num_batched_tokens=8192, cuda_graph_max_packed_tokens=2048)
    inputs, runner = llm.engine.inputs, llm.engine.runner
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"packed": [], "eager": []}
    for i in range(12):
        mode = "packed" if i % 2 else "eager"
        runner.packed.max_tokens = 2048 if mode == "packed" else 1024
        prompt = inputs.prepare_chat(chat(random_images([(448, 448)] * 8, seed=400 + i), "Describe every picture."))
        before = runner.stats.packed_graph_steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], one)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        if i >= 2:
            times[mode].append(ms)
        print(f"{mode}: {ms:.1f} ms, packed steps +{runner.stats.packed_graph_steps - before}, "
              f"{len(prompt.token_ids)} tokens", flush=True)
    for mode, values in times.items():
        values.sort()
        print(f"{mode}: median {values[len(values) // 2]:.1f} ms of {[round(v, 1) for v in values]}", flush=True)


if __name__ == "__main__":
    main()
