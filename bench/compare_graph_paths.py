"""A/B on the GPU (not part of `nox -s bench`): which CUDA-graph path should run a short question after a
prefix hit, the one-token rows or the packed graphs; W2 in-process with the images named by uuid; and W4
with interleaving after encoding ahead was spread over steps. Prints medians; writes them to --out."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_workloads import CKPT, chat, w4_injection  # noqa: E402

from prism.engine import runner as runner_mod  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def question_after_hit_ms(llm: LLM, images, reps: int = 7) -> float:
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    prompts = [llm.engine.inputs.prepare_chat(chat(images, f"New question {i}: which is brightest?"))
               for i in range(reps)]
    walls = []
    for prompt in prompts:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], one)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    return statistics.median(walls)


def ttft_by_uuid_ms(llm: LLM, images, reps: int = 7) -> float:
    """W2 in-process with the images named by uuid after being sent once with them: preparation (no pixel
    hashing) + the engine, to the first token."""
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    names = [f"bench-{i}" for i in range(len(images))]
    inputs = llm.engine.inputs

    def message(text: str, send: bool) -> list[dict]:
        parts = [{"type": "image", "image": im if send else None, "uuid": n} for im, n in zip(images, names, strict=True)]
        return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]

    llm.generate([inputs.prepare_chat(message("Naming the pictures.", True))], one)
    walls = []
    for i in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([inputs.prepare_chat(message(f"Question {i} by name: which is darkest?", False))], one)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    return statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/compare-graph-paths.json")
    parser.add_argument("--w2-only", action="store_true", help="skip the W4 runs")
    args = parser.parse_args()
    if not (CKPT / "config.json").exists():
        build_checkpoint("8b", CKPT, device="cuda", progress=True)
    out: dict = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    llm = LLM(CKPT, kv_memory_bytes=8 * 2**30, page_size=256)
    hot = random_images([(448, 448)] * 8, seed=7)
    llm.generate([llm.engine.inputs.prepare_chat(chat(hot, "First question."))],
                 SamplingParams.greedy(max_tokens=1, ignore_eos=True))
    out["w2_engine_packed_ms"] = question_after_hit_ms(llm, hot)  # the default for a step with a prefill
    original = runner_mod.ModelRunner._graph_for

    def rows_first(self, pieces, media):
        tokens, longest = sum(p.end - p.start for p in pieces), max(p.end for p in pieces)
        reads = sum((p.end - p.start) * p.end for p in pieces if p.end - p.start > 1)
        if (self.graphs is not None and not media and reads <= runner_mod.MAX_GRAPH_PREFILL_KEY_READS
                and self.graphs.fits(tokens, longest)):
            return "rows"
        return original(self, pieces, media)

    runner_mod.ModelRunner._graph_for = rows_first
    out["w2_engine_rows_ms"] = question_after_hit_ms(llm, hot)
    runner_mod.ModelRunner._graph_for = original
    out["w2_ttft_by_uuid_ms"] = ttft_by_uuid_ms(llm, hot)
    print(json.dumps(out), flush=True)
    save()
    del llm
    torch.cuda.empty_cache()
    for interleave in () if args.w2_only else (512, 256):
        r = w4_injection(CKPT, 448, 8, 12 * 2**30, interleave)
        out[f"w4_interleave_{interleave}"] = {k: v for k, v in r.items() if k != "gaps_ms"}
        print(interleave, json.dumps(out[f"w4_interleave_{interleave}"]), flush=True)
        save()


if __name__ == "__main__":
    main()
