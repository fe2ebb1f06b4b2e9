"""Where the time of Prism's *eager* steps goes on the GPU: the vision encoder of 8 new images, a cold
W1 request, W4's interleaved chunk steps (256 prompt tokens beside 8 decodes) and a hot W7 decide.

Not a benchmark. For each case it prints the wall time, the GPU's busy time (sum of kernel times) and the
top operators by host and by device time, plus a cProfile of the host side; a step whose wall time is far
above its GPU time is host-bound. Writes the same text to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_decide import QUESTIONS, material  # noqa: E402
from profile_hot_paths import chat  # noqa: E402

from prism.engine import engine as engine_mod  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.media.pixels import pixels_on  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

OUT: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    OUT.append(text)


def device_busy_ms(prof) -> float:
    return sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0) / 1e3


def examine(label: str, fn, *, host_profile: bool = True, rows: int = 18) -> None:
    """fn runs three times: timed, under torch.profiler, under cProfile (fn must be repeatable)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    say(f"\n=== {label}: wall {wall:.1f} ms, GPU busy {device_busy_ms(prof):.1f} ms (under the profiler)")
    averages = prof.key_averages()
    say(averages.table(sort_by="self_device_time_total", row_limit=rows))
    say(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    if host_profile:
        prof_host = cProfile.Profile()
        prof_host.enable()
        fn()
        torch.cuda.synchronize()
        prof_host.disable()
        text = io.StringIO()
        pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(25)
        say(text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--out", default="bench/results/profile-steps.txt")
    args = parser.parse_args()
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)

    llm = LLM(ckpt, kv_memory_bytes=12 * 2**30, page_size=256, interleave_prefill_tokens=256)
    engine = llm.engine
    seeds = iter(range(1000, 10**6))

    def cold_prompt():
        return engine.inputs.prepare_chat(chat(random_images([(448, 448)] * 8, seed=next(seeds)), "Describe all."))

    for _ in range(2):
        llm.generate([cold_prompt()], one)

    # The vision encoder alone, 8 new 448x448 images (the prepared patches as the runner hands them over).
    prompt = cold_prompt()
    pixels = torch.cat([pixels_on(m.pixels, engine.runner.device) for m in prompt.media])
    grids = [m.grid_thw for m in prompt.media]
    examine("vision encoder, 8 images 448x448", lambda: engine.runner.model.encode_media(pixels, grids))
    torch.backends.cuda.enable_cudnn_sdp(False)
    examine("vision encoder, cuDNN SDPA off", lambda: engine.runner.model.encode_media(pixels, grids),
            host_profile=False, rows=8)
    torch.backends.cuda.enable_cudnn_sdp(True)

    # W4's interleaved chunk steps: 8 decodes running, a cold 8-image request arrives; each step examined alone.
    for i in range(8):
        engine.add_request(f"long{i}", f"Tell a long story {i}.", SamplingParams.greedy(max_tokens=300, ignore_eos=True))
    for _ in range(10):
        engine.step()
    engine.add_request("cold", cold_prompt(), SamplingParams.greedy(max_tokens=2, ignore_eos=True))
    snapshot_steps = []
    step = engine_mod.Engine.step
    for k in range(9):
        before = engine.runner.stats.tokens_computed
        torch.cuda.synchronize()
        t = time.perf_counter()
        if k in (2, 4):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(engine)
                torch.cuda.synchronize()
            say(f"\n=== interleaved step {k}: GPU busy {device_busy_ms(prof):.1f} ms")
            say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
            say(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
        elif k == 3:
            prof_host = cProfile.Profile()
            prof_host.enable()
            step(engine)
            torch.cuda.synchronize()
            prof_host.disable()
            text = io.StringIO()
            pstats.Stats(prof_host, stream=text).sort_stats("tottime").print_stats(30)
            say(f"\n=== interleaved step {k}, cProfile\n{text.getvalue()}")
        else:
            step(engine)
        torch.cuda.synchronize()
        snapshot_steps.append((k, (time.perf_counter() - t) * 1e3, engine.runner.stats.tokens_computed - before))
    say("interleaved steps (k, wall ms, tokens): " + ", ".join(f"({k}, {w:.1f}, {n})" for k, w, n in snapshot_steps))
    while engine.has_unfinished_requests():
        engine.step()

    # A hot decide: same material again (full hit).
    mat = material(seed=77)
    llm.decide(mat, QUESTIONS)
    steps_before = engine.runner.stats.steps
    llm.decide(mat, QUESTIONS)
    say(f"hot decide: {engine.runner.stats.steps - steps_before} engine steps")
    examine("hot decide (3 questions, full hit)", lambda: llm.decide(mat, QUESTIONS))

    # W1 cold engine part (prepared prompt).
    prompts = iter([cold_prompt() for _ in range(3)])
    examine("W1 cold, prepared prompt, 1 token", lambda: llm.generate([next(prompts)], one))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(OUT))


if __name__ == "__main__":
    main()
