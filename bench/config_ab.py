"""W3's decode step on two engines that differ in one EngineConfig field, alternating (not part of `nox -s bench`).

`--field async_scheduling --values false,true` (session 6's A/B), `--field cascade_attention_min_batch
--values 0,8`. Same checkpoint, prompts and measurement as `bench_engine.py`'s W3 (batch 1, 8, 32 over the same 8
hot images, 128 greedy tokens, the step time without the first token); each batch is measured `--reps` times per
engine, alternating, so both see the same GPU clocks. `--variants 'batch1_fused_norms=false;pdl.TRIGGER_FIRST=false'`:
instead of one field, engines given as sets of settings, each an EngineConfig field or (in capitals) a launch knob of
`prism.ops.gemv` captured into that engine's graphs (session 16's tilings: `--variants
'BLOCK_N=8,BLOCK_K=512;BLOCK_N=4,BLOCK_K=1024'`). `--w2 N`: W2's engine part too (as bench_engine.py's), N times
per engine, alternating. Both engines are loaded at once (8B: ~2 x 33 GB). Prints
medians and writes them, with the samples, to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_engine import chat, w3_step_seconds  # noqa: E402
from kernel_timing import module_knobs  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402
from prism.testing.knobs import ops_knob, parse_value  # noqa: E402


def build(ckpt: Path, kv: str, kv_gib: int, **config) -> LLM:
    """An engine as bench_engine.py's W3 builds it, with `kv_gib` GiB of KV memory (less when several are loaded)."""
    return LLM(ckpt, kv_dtype=kv, kv_memory_bytes=kv_gib * 2**30, page_size=256, max_num_seqs=64,
               max_num_batched_tokens=8192, **config)


def engines_of_variants(ckpt: Path, kv: str, kv_gib: int, variants: list[str]) -> dict[str, LLM]:
    """One engine per variant `NAME=VALUE,NAME=VALUE`: lowercase names are EngineConfig fields, capitals launch knobs
    of `prism.ops.gemv`, `module.NAME` a knob of `prism.ops.<module>` (e.g. `pdl.TRIGGER_FIRST`). The graphs capture
    the knobs set when they are built, so the engines keep theirs after the modules' are restored; their eager steps
    (the prefills) use the modules', which the decode steps measured here do not run. Knobs reach this process only:
    tensor-parallel follower ranks (processes of their own) keep their modules' defaults."""
    engines = {}
    for variant in (v.strip() for v in variants):
        if not variant:
            continue  # ("a=1;" has no third engine)
        items = [item.strip() for item in variant.split(",") if item.strip()]
        if any("=" not in item for item in items):
            raise SystemExit(f"--variants: {variant!r} is not NAME=VALUE[,NAME=VALUE...]")
        settings = dict(item.split("=", 1) for item in items)
        knobs: dict[ModuleType, dict] = {}
        fields = {}
        for name, value in settings.items():
            if "." in name or name.isupper():
                module, knob = ops_knob(name, default_module="gemv")
                knobs.setdefault(module, {})[knob] = parse_value(value)
            else:
                fields[name] = parse_value(value)
        with contextlib.ExitStack() as stack:
            for module, values in knobs.items():
                stack.enter_context(module_knobs(module, values))
            engines[variant] = build(ckpt, kv, kv_gib, **fields)
    return engines


def w2_engine_ms(engines: dict[str, LLM], images, one: SamplingParams, reps: int) -> dict:
    """W2's engine part on each engine, alternating: medians (ms) and samples."""
    for label, llm in engines.items():
        for seed in (995, 996):  # the cold 8-image prefill's vision graph: captured on the second
            llm.generate([llm.engine.inputs.prepare_chat(chat(random_images([(448, 448)] * 8, seed=seed), "warm"))],
                         one)
        llm.generate([llm.engine.inputs.prepare_chat(chat(images, f"First question ({label})."))], one)
    times: dict[str, list[float]] = {label: [] for label in engines}
    for i in range(reps):
        for label, llm in engines.items():
            prompt = llm.engine.inputs.prepare_chat(chat(images, f"New question number {i}: which is darkest?"))
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], one)
            torch.cuda.synchronize()
            times[label].append((time.perf_counter() - start) * 1e3)
    medians = {label: statistics.median(v) for label, v in times.items()}
    print("W2 engine part: " + ", ".join(f"{label} {ms:.2f} ms" for label, ms in medians.items()) + f"  {times}",
          flush=True)
    return {**medians, "samples": times}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--field", default="async_scheduling")
    parser.add_argument("--values", default="false,true", help="the two values of --field, baseline first")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench/results/config_ab.json")
    parser.add_argument("--kv", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--variants", default="", help="instead of --field: ';'-separated engines, each NAME=VALUE "
                        "settings (',' between them): EngineConfig fields, or prism.ops.gemv launch knobs in capitals")
    parser.add_argument("--w2", type=int, default=0, help="also W2's engine part (a new question on 8 cached images, "
                        "from a prepared prompt to the first token), this many times per engine, alternating")
    parser.add_argument("--kv-gib", type=int, default=16, help="each engine's KV memory")
    args = parser.parse_args()
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    if args.variants:
        engines = engines_of_variants(ckpt, args.kv, args.kv_gib, args.variants.split(";"))
    else:
        values = [parse_value(v) for v in args.values.split(",")]
        engines = {f"{args.field}={value}": build(ckpt, args.kv, args.kv_gib, **{args.field: value}) for value in values}
    labels = list(engines)
    images = random_images([(448, 448)] * 8, seed=7)
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    results: dict[str, dict] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {label: [] for label in labels}
        prompts = {}
        for label, llm in engines.items():
            prompts[label] = [llm.engine.inputs.prepare_chat(chat(images, f"Decode test {batch}-{i}"))
                              for i in range(batch)]
            llm.generate(prompts[label], one)  # cache the prefix
            llm.generate(prompts[label], SamplingParams.greedy(max_tokens=16, ignore_eos=True))  # warm
        for _ in range(args.reps):
            for label, llm in engines.items():
                times[label].append(w3_step_seconds(llm, prompts[label]) * 1e3)
        results[f"batch{batch}"] = {label: statistics.median(v) for label, v in times.items()}
        results[f"batch{batch}"]["samples"] = times
        print(f"W3 batch {batch}: " + ", ".join(f"{label} {results[f'batch{batch}'][label]:.2f} ms"
                                                 for label in labels) + f" per step  {times}", flush=True)
    if args.w2:
        results["W2_engine_ms"] = w2_engine_ms(engines, images, one, args.w2)
    if "batch1" in results and "batch32" in results:
        b1, b32 = results["batch1"], results["batch32"]
        print("batch 32 / batch 1: " + ", ".join(f"{label} {b32[label] / b1[label]:.3f}x" for label in labels))
    results["device"] = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
