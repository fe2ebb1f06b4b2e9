"""W3's decode step with and without the shared-pages decode kernel (not part of `nox -s bench`).

One engine per setting (the CUDA graphs capture the kernel chosen when they are built), one after the other in one
process: `paged_attention._SHARED_PAGES_SEQS` = 0 (`_decode_kernel`, one program per sequence) and each value of
--seqs (sequences per program of `decode_shared_pages.py`, from `_SHARED_PAGES_MIN_BATCH` sequences on). Same
prompts and measurement as `bench_engine.py`'s W3 (128 greedy tokens over the same 8 hot images, the step time
without the first token); prints medians and writes them to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_engine import chat, cuda_time  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.ops import paged_attention as pa  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--seqs", default="4")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default="bench/results/shared_pages_ab.json")
    args = parser.parse_args()
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    images = random_images([(448, 448)] * 8, seed=7)
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    tokens = 128
    params = SamplingParams.greedy(max_tokens=tokens, ignore_eos=True)
    results: dict[str, dict] = {}
    for seqs in [0, *(int(s) for s in args.seqs.split(","))]:
        pa._SHARED_PAGES_SEQS = seqs
        llm = LLM(ckpt, kv_dtype="fp8", kv_memory_bytes=16 * 2**30, page_size=256, max_num_seqs=64,
                  max_num_batched_tokens=8192)
        row: dict[str, float] = {}
        tokens_out = {}
        for batch in (1, 8, 32):
            prompts = [llm.engine.inputs.prepare_chat(chat(images, f"Decode test {batch}-{i}")) for i in range(batch)]
            llm.generate(prompts, one)  # cache the prefix
            tokens_out[batch] = [c.token_ids for c in llm.generate(prompts, SamplingParams.greedy(max_tokens=16))]
            samples = []
            for _ in range(args.reps):
                t_all = cuda_time(lambda ps=prompts, m=llm: m.generate(ps, params))
                t_one = cuda_time(lambda ps=prompts, m=llm: m.generate(ps, one))
                samples.append((t_all - t_one) / (tokens - 1) * 1e3)
            row[f"batch{batch}"] = statistics.median(samples)
        row["ratio32"] = row["batch32"] / row["batch1"]
        results[f"seqs{seqs}"] = row
        if seqs:
            same = tokens_out == results["tokens0"]
            row["same_greedy_tokens_as_seqs0"] = same
        else:
            results["tokens0"] = tokens_out
        print(f"sequences per program {seqs}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                             for k, v in row.items()), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    results.pop("tokens0", None)
    results["device"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
