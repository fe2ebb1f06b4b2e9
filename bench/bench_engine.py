"""GPU benchmark, in-process: Prism vs plain HF transformers on a random-weight Qwen3-VL-8B (same run).

Workloads (REFERENCE §5): W1 cold 8 images (448x448) + question TTFT; W2 the same 8 images + a new
question TTFT; W3 decode TPOT at batch 1 (and step time at batch 8 / 32); W6 KV tokens per GiB.
Prism uses scaled-FP8 KV (and BF16 KV for the W3 comparison), CUDA-graph decode. The peer is HF
`generate` (sdpa) on the same checkpoint and the same prepared inputs. Greedy tokens are compared.
W1 and W2 TTFT count from the raw chat messages handed to the engine (`LLM.generate`), which prepares them (before
session 8's last change the harness prepared the prompt itself, then generated); "engine alone" starts from a
prompt prepared beforehand. A W2 row for clients that name their images (`uuid`: sent once, then named alone, so
nothing is hashed or sent again) is reported beside the target's row, which is for pixels.
Writes bench/results/<date>-<gpu>.json and .md; `--quick` runs fewer repetitions.

W4, W5: `bench_workloads.py`; W7: `bench_decide.py`; over HTTP: `bench_http.py`.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_io import write_results  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.kv import fp8  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def cuda_time(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def w3_step_seconds(llm, prompts, tokens: int = 128) -> float:
    """W3's decode step: `tokens` greedy tokens of `prompts` (prefix cached) less one token, per step after the first."""
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    t_all = cuda_time(lambda: llm.generate(prompts, SamplingParams.greedy(max_tokens=tokens, ignore_eos=True)))
    t_one = cuda_time(lambda: llm.generate(prompts, one))
    return (t_all - t_one) / (tokens - 1)


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "mean_ms": statistics.fmean(samples) * 1e3,
        "median_ms": statistics.median(samples) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
        "n": len(samples),
    }


def chat(images, question: str, uuids=None) -> list[dict]:
    """One user turn: the images (None: named by its uuid alone), then the question."""
    parts = [{"type": "image", "image": im} | ({"uuid": uuids[k]} if uuids else {}) for k, im in enumerate(images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def hf_inputs(prompt, device="cuda") -> dict:
    kw = {
        "input_ids": torch.tensor([prompt.token_ids], device=device),
        "attention_mask": torch.ones(1, len(prompt.token_ids), dtype=torch.long, device=device),
        "mm_token_type_ids": torch.as_tensor(prompt.mm_token_type_ids)[None].to(device),
    }
    if prompt.images:
        kw["pixel_values"] = torch.cat([m.pixel_values for m in prompt.images]).to(device)
        kw["image_grid_thw"] = prompt.image_grid_thw.to(device)
    return kw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="Prism's ranks (TP2: the text decoder "
                        "sharded over two GPUs); HF runs on one GPU either way")
    parser.add_argument("--tensor-parallel-async", action="store_true", help="with --tensor-parallel 2: the engine's "
                        "tensor_parallel_async_scheduling (async scheduling under TP, off by default)")
    args = parser.parse_args()
    tp = args.tensor_parallel
    reps = 3 if args.quick else 10
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():  # built in its own process: see make_checkpoint.py
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_checkpoint.py"), "--ckpt", str(ckpt)], check=True)
    gpu = torch.cuda.get_device_name()
    results: dict = {"gpu": gpu, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                     "checkpoint": "random-weight Qwen3-VL-8B shapes, bf16", "tensor_parallel": tp,
                     "tensor_parallel_async_scheduling": args.tensor_parallel_async, "workloads": {}}
    w = results["workloads"]

    # -- W6 capacity (arithmetic, scales counted) --------------------------------------------------
    bf16 = fp8.tokens_per_gib(36, 8, 128, "bf16")
    f8 = fp8.tokens_per_gib(36, 8, 128, "fp8")
    w["W6"] = {"bf16_tokens_per_gib": bf16, "fp8_tokens_per_gib": f8, "ratio": f8 / bf16}

    # -- Prism ---------------------------------------------------------------------------------------
    def prism(kv_dtype: str) -> LLM:
        return LLM(ckpt, kv_dtype=kv_dtype, kv_memory_bytes=16 * 2**30, page_size=256, max_num_seqs=64,
                   max_num_batched_tokens=8192, tensor_parallel_size=tp,
                   tensor_parallel_async_scheduling=args.tensor_parallel_async)

    llm = prism("fp8")
    inputs = llm.engine.inputs
    one_token = SamplingParams.greedy(max_tokens=1, ignore_eos=True)

    def ttft(messages) -> float:
        """TTFT from the raw chat messages as a caller of the engine pays it: the engine prepares them."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([messages], one_token)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def engine_part(messages) -> float:
        """The engine's part alone: from a prompt prepared beforehand to the first token."""
        prompt = inputs.prepare_chat(messages)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], one_token)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    # warm up kernels and allocations (and capture the vision graphs of the sizes used)
    for seed in (997, 998, 999):
        ttft(chat(random_images([(448, 448)] * 8, seed=seed), "warm up"))
    for seed in (995, 996):  # the 8-image grid list a prepared prompt's prefill encodes: captured on the second
        engine_part(chat(random_images([(448, 448)] * 8, seed=seed), "warm up"))
    cold = [ttft(chat(random_images([(448, 448)] * 8, seed=100 + i), "Describe every picture.")) for i in range(reps)]
    cold_engine = [engine_part(chat(random_images([(448, 448)] * 8, seed=200 + i), "Describe every picture."))
                   for i in range(reps)]
    hot_images = random_images([(448, 448)] * 8, seed=7)
    ttft(chat(hot_images, "First question about these pictures."))
    hot = [ttft(chat(hot_images, f"New question number {i}: which picture is brightest?")) for i in range(reps)]
    hot_engine = [engine_part(chat(hot_images, f"Another question number {i}: which is darkest?")) for i in range(reps)]
    w["W1_prism_fp8"] = summary(cold)
    w["W1_prism_fp8_engine_only"] = summary(cold_engine)
    w["W2_prism_fp8"] = summary(hot)
    w["W2_prism_fp8_engine_only"] = summary(hot_engine)
    # W2 as a client that names its images (`uuid`, vLLM's multi_modal_uuids): sent once with their pixels, then by
    # name alone, so later requests neither hash nor send pixels. Not the target's row: the target is for pixels.
    names = [f"w2-image-{k}" for k in range(len(hot_images))]
    ttft(chat(hot_images, "Named pictures: first question.", uuids=names))
    named = [ttft(chat([None] * len(names), f"Named question {i}: which is brightest?", uuids=names))
             for i in range(reps)]
    w["W2_prism_fp8_image_uuids"] = summary(named)

    def tpot(llm_, batch: int) -> float:
        prompts = [inputs.prepare_chat(chat(hot_images, f"Decode test {batch}-{i}")) for i in range(batch)]
        llm_.generate(prompts, SamplingParams.greedy(max_tokens=1, ignore_eos=True))  # cache the prefix
        # One untimed decode first: a fresh engine's first decode steps measured slower (BF16: 5.75 ms, then 4.89 warm).
        llm_.generate(prompts, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
        return w3_step_seconds(llm_, prompts)

    for batch in (1, 8, 32):
        w[f"W3_prism_fp8_batch{batch}_step_ms"] = tpot(llm, batch) * 1e3
    greedy_prompt = inputs.prepare_chat(chat(hot_images, "Tell me about the pictures."))
    prism_tokens = llm.generate([greedy_prompt], SamplingParams.greedy(max_tokens=16, ignore_eos=True))[0].token_ids
    llm.engine.shutdown()  # its follower ranks (TP), then its weights and KV pool, before the next engine
    llm = None
    torch.cuda.empty_cache()

    llm16 = prism("bf16")
    inputs = llm16.engine.inputs
    w["W3_prism_bf16_batch1_step_ms"] = tpot(llm16, 1) * 1e3
    llm16.engine.shutdown()
    llm16 = None
    torch.cuda.empty_cache()

    # -- the peer: plain HF transformers ---------------------------------------------------------------
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    hf = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.to("cuda").eval()

    def hf_generate(prompt, n: int):
        gc = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.no_grad():
            return hf.generate(**hf_inputs(prompt), generation_config=gc)

    def hf_ttft(messages) -> float:
        """HF's TTFT from the raw messages (the same input preparation, then one generated token)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        prompt = inputs.prepare_chat(messages)
        hf_generate(prompt, 1)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    hf_ttft(chat(random_images([(448, 448)] * 8, seed=999), "warm up"))
    # New images for HF too (Prism's cold seeds are in the preprocessing cache by now).
    hf_cold = [hf_ttft(chat(random_images([(448, 448)] * 8, seed=300 + i), "Describe every picture.")) for i in range(reps)]
    hf_hot = [hf_ttft(chat(hot_images, f"New question number {i}: which picture is brightest?")) for i in range(reps)]
    w["W1_hf"] = summary(hf_cold)
    w["W2_hf"] = summary(hf_hot)
    p1 = inputs.prepare_chat(chat(hot_images, "Decode test 1-0"))
    t_all = cuda_time(lambda: hf_generate(p1, 32))
    t_one = cuda_time(lambda: hf_generate(p1, 1))
    w["W3_hf_batch1_step_ms"] = (t_all - t_one) / 31 * 1e3
    hf_tokens = hf_generate(greedy_prompt, 16)[0, len(greedy_prompt.token_ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(prism_tokens, hf_tokens, strict=True)) if a != b), 16)
    results["greedy_agreement"] = {"prism_fp8_kv": prism_tokens, "hf": hf_tokens, "identical_prefix_tokens": same}

    table = markdown(results)
    write_results(results, table, gpu, results["date"], suffix=f"tp{tp}" if tp > 1 else "")
    print(table)


def markdown(r: dict) -> str:
    w = r["workloads"]
    tp = r.get("tensor_parallel", 1)
    tp_label = f", TP{tp}" if tp > 1 else ""
    if tp > 1 and r.get("tensor_parallel_async_scheduling"):
        tp_label += " (async scheduling)"
    lines = [
        f"GPU: {r['gpu']}, torch {r['torch']}, {r['checkpoint']}, {r['date']}",
        "",
        f"| workload | Prism (FP8 KV{tp_label}) | HF transformers | target |",
        "|---|---:|---:|---:|",
        f"| W1 cold 8 images TTFT incl. input preparation, median ms | {w['W1_prism_fp8']['median_ms']:.1f} (engine alone {w['W1_prism_fp8_engine_only']['median_ms']:.1f}) | {w['W1_hf']['median_ms']:.1f} | <= 60 |",
        f"| W2 same images + new question TTFT incl. input preparation, median ms | {w['W2_prism_fp8']['median_ms']:.1f} (engine alone {w['W2_prism_fp8_engine_only']['median_ms']:.1f}) | {w['W2_hf']['median_ms']:.1f} | <= 10 |",
        f"| W2 with image uuids (images named, not sent again), median ms | {w['W2_prism_fp8_image_uuids']['median_ms']:.1f} | | |",
        f"| W3 batch-1 decode step, ms | {w['W3_prism_fp8_batch1_step_ms']:.2f} (BF16 KV {w['W3_prism_bf16_batch1_step_ms']:.2f}) | {w['W3_hf_batch1_step_ms']:.2f} | <= 4.0 |",
        f"| W3 batch-8 decode step, ms | {w['W3_prism_fp8_batch8_step_ms']:.2f} | | |",
        f"| W3 batch-32 decode step, ms | {w['W3_prism_fp8_batch32_step_ms']:.2f} | | <= 1.3x batch 1 |",
        f"| W6 KV tokens per GiB | {w['W6']['fp8_tokens_per_gib']:.0f} ({w['W6']['ratio']:.3f}x BF16) | {w['W6']['bf16_tokens_per_gib']:.0f} (BF16) | >= 1.93x |",
        "",
        f"Greedy tokens, Prism FP8 KV vs HF bf16: first {r['greedy_agreement']['identical_prefix_tokens']} of 16 identical.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
