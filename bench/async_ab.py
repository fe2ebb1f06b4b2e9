"""W3's decode step with async scheduling on and off, alternating in one engine (not part of `nox -s bench`).

Same checkpoint, prompts and measurement as `bench_engine.py`'s W3 (batch 1, 8, 32 over the same 8 hot images,
128 greedy tokens, the step time without the first token), each batch measured `--reps` times per mode,
alternating, so both modes see the same GPU clocks and cache state. Prints medians and writes them to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_engine import chat, w3_step_seconds  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/async_ab.json")
    parser.add_argument("--kv", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args()
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    llm = LLM(ckpt, kv_dtype=args.kv, kv_memory_bytes=16 * 2**30, page_size=256, max_num_seqs=64,
              max_num_batched_tokens=8192)
    engine = llm.engine
    on, off = engine.config, engine.config.replace(async_scheduling=False)
    images = random_images([(448, 448)] * 8, seed=7)
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    results: dict[str, dict[str, float]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [engine.inputs.prepare_chat(chat(images, f"Decode test {batch}-{i}")) for i in range(batch)]
        llm.generate(prompts, one)  # cache the prefix
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.reps):
            for mode, config in (("off", off), ("on", on)):
                engine.config = config  # the engine reads the flag at every step
                times[mode].append(w3_step_seconds(llm, prompts) * 1e3)
        engine.config = on
        results[f"batch{batch}"] = {mode: statistics.median(v) for mode, v in times.items()}
        results[f"batch{batch}"]["samples"] = times
        print(f"W3 batch {batch}: async off {results[f'batch{batch}']['off']:.2f} ms, "
              f"on {results[f'batch{batch}']['on']:.2f} ms per step  {times}", flush=True)
    if "batch1" in results and "batch32" in results:
        b1, b32 = results["batch1"], results["batch32"]
        print(f"batch 32 / batch 1: off {b32['off'] / b1['off']:.2f}x, on {b32['on'] / b1['on']:.2f}x")
    results["device"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
