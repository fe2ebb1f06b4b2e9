"""Profile Prism's hot paths on the GPU (W1 cold, W2 hot, W3 decode at batch 1 and 32).

Not a benchmark: it wraps the engine's stages in `torch.profiler.record_function` ranges and prints
where host and device time go, plus the hardware floors (copy bandwidth, bf16 GEMM rate) that
`bench/RESULTS.md` compares against. Writes tables and Chrome traces to --out.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kernel_timing import copy_bandwidth  # noqa: E402

from prism.engine import engine as engine_mod  # noqa: E402
from prism.engine import runner as runner_mod  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def ranged(obj, name: str, label: str) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapper)


def chat(images, question: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": question}]}]


def floors(out: Path) -> None:
    copy_bw = copy_bandwidth()  # read + write
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 20 / (time.perf_counter() - t)
    line = f"copy bandwidth (read+write) {copy_bw / 1e12:.2f} TB/s; bf16 GEMM 8192^3 {flops / 1e12:.0f} TFLOP/s\n"
    print(line)
    (out / "floors.txt").write_text(line)


def timeline(prof) -> str:
    """When the host ranges and the graph launches ran, and when the device was busy, in ms from the first host
    range: does the device start as the launch call starts, or only once it returns?"""
    from torch.autograd import DeviceType

    events = list(prof.events())
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    host_names = {e.name for e in cpu}  # the record_function ranges appear on the device too: not kernels
    gpu = [e for e in events if e.device_type == DeviceType.CUDA and e.name not in host_names]
    # Our ranges, the launch and sync calls, and any other host op of 100 us or more (what holds the host).
    marks = [e for e in cpu if "." in e.name and not e.name.startswith("aten::")
             or e.name in ("cudaGraphLaunch", "cudaEventSynchronize", "cudaStreamSynchronize")
             or e.time_range.end - e.time_range.start >= 100]
    if not cpu or not gpu:
        return "timeline: no events"
    t0 = min(e.time_range.start for e in cpu)
    lines = ["timeline (ms from the first host event): host ranges, then device activity"]
    for e in sorted(marks, key=lambda e: e.time_range.start)[:70]:
        lines.append(f"  host {e.name:<28} {(e.time_range.start - t0) / 1e3:8.3f} -> {(e.time_range.end - t0) / 1e3:8.3f}")
    starts = sorted(e.time_range.start for e in gpu)
    ends = sorted(e.time_range.end for e in gpu)
    busy = sum(e.time_range.end - e.time_range.start for e in gpu)
    lines.append(f"  device first kernel start {(starts[0] - t0) / 1e3:8.3f}, last kernel end {(ends[-1] - t0) / 1e3:8.3f}, "
                 f"kernels busy {busy / 1e3:.3f} ms over {len(gpu)} kernels")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--out", default="bench/results/profile")
    parser.add_argument("--traces", action="store_true", help="also write Chrome traces (large)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    floors(out)

    ranged(engine_mod.Scheduler, "schedule", "scheduler.schedule")
    ranged(engine_mod.Engine, "_commit", "engine.commit")
    ranged(engine_mod, "sample", "sampler.sample")
    ranged(runner_mod.ModelRunner, "execute", "runner.execute")
    ranged(runner_mod.ModelRunner, "prepare", "runner.prepare")
    ranged(runner_mod.ModelRunner, "_encode", "runner.encode")
    ranged(runner_mod.PagedAttentionMetadata, "build", "attention.metadata_build")
    ranged(runner_mod.RowGraphs, "run", "graphs.run")
    ranged(runner_mod.Qwen3VLModel, "encode_media", "model.encode_media")
    ranged(runner_mod.Qwen3VLModel, "forward", "model.forward")

    llm = LLM(ckpt, kv_dtype="fp8", kv_memory_bytes=16 * 2**30, page_size=256, max_num_seqs=64,
              max_num_batched_tokens=8192)
    inputs = llm.engine.inputs
    ranged(inputs, "prepare_chat", "inputs.prepare_chat")
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    hot = random_images([(448, 448)] * 8, seed=7)
    for i in range(3):
        llm.generate([inputs.prepare_chat(chat(random_images([(448, 448)] * 8, seed=900 + i), "warm"))], one)
    llm.generate([inputs.prepare_chat(chat(hot, "first question"))], one)

    def timed(label, fn, reps=5):
        walls = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1e3)
        line = f"{label}: median {sorted(walls)[len(walls) // 2]:.2f} ms ({', '.join(f'{w:.1f}' for w in walls)})"
        print(line)
        with open(out / "walls.txt", "a") as f:
            f.write(line + "\n")

    counter = iter(range(10**6))
    # Host side of a hot request, by Python function (the H200's host differs from the CPU machine's).
    import cProfile
    import io
    import pstats

    prof_host = cProfile.Profile()
    prof_host.enable()
    for _ in range(10):
        inputs.prepare_chat(chat(hot, f"q {next(counter)}"))
    prof_host.disable()
    text = io.StringIO()
    pstats.Stats(prof_host, stream=text).sort_stats("cumulative").print_stats(30)
    (out / "prepare_chat_cprofile.txt").write_text(text.getvalue())
    print(text.getvalue())
    timed("W2 prepare_chat (8 hot PIL images)", lambda: inputs.prepare_chat(chat(hot, f"q {next(counter)}")))
    prompts = [inputs.prepare_chat(chat(hot, f"new question {i}?")) for i in range(5)]
    it = iter(prompts)
    timed("W2 generate only (prepared prompt, full hit)", lambda: llm.generate([next(it)], one))
    cold_images = [random_images([(448, 448)] * 8, seed=100 + i) for i in range(5)]
    it2 = iter(cold_images)
    timed("W1 prepare_chat (8 new PIL images)", lambda: inputs.prepare_chat(chat(next(it2), "describe")))
    cold_prompts = [inputs.prepare_chat(chat(random_images([(448, 448)] * 8, seed=200 + i), "describe")) for i in range(5)]
    it3 = iter(cold_prompts)
    timed("W1 generate only (prepared, cold)", lambda: llm.generate([next(it3)], one))

    def trace(label, fn):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
            fn()
            torch.cuda.synchronize()
        if args.traces:
            prof.export_chrome_trace(str(out / f"{label}.json"))
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=45)
        table_gpu = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        (out / f"{label}.txt").write_text(table + "\n\n" + table_gpu + "\n\n" + timeline(prof))
        print(f"=== {label} (by cpu) ===\n{table}\n=== {label} (by cuda) ===\n{table_gpu}\n{timeline(prof)}")

    trace("W2_hot", lambda: llm.generate([inputs.prepare_chat(chat(hot, "profiled question?"))], one))
    trace("W1_cold", lambda: llm.generate([inputs.prepare_chat(chat(random_images([(448, 448)] * 8, seed=555), "d"))], one))
    for batch in (1, 32):
        ps = [inputs.prepare_chat(chat(hot, f"decode {batch}-{i}")) for i in range(batch)]
        llm.generate(ps, one)
        params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
        trace(f"W3_b{batch}_24tok", lambda ps=ps, params=params: llm.generate(ps, params))
        t_all_prompts = [inputs.prepare_chat(chat(hot, f"decode timing {batch}-{i}")) for i in range(batch)]
        llm.generate(t_all_prompts, one)
        timed(f"W3 batch {batch} generate 64 tokens",
              lambda ps=t_all_prompts: llm.generate(ps, SamplingParams.greedy(max_tokens=64, ignore_eos=True)), reps=2)


if __name__ == "__main__":
    main()
