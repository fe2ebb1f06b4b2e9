"""Where W3's decode step goes, kernel by kernel, with programmatic dependent launch off and on (`--batch`: 1 by
default; `--pdl on` / `off` for one setting only).

Not a benchmark. For each setting it profiles (torch.profiler, CUDA activity) a greedy generation of 1 token and
of `1 + STEPS` tokens of the same hot 8-image prompt (as W3's), subtracts the first from the second and divides by
STEPS: each kernel's launches and device time per decode step, the step's wall time, and the device's idle time
between kernels. With PDL on, a kernel's measured duration includes the time its blocks wait for the previous
kernel, so per-kernel times are only meaningful with it off; the idle time is meaningful both ways. Also prints
the kernels of one decoder layer in the middle of a step, in order, with the gap before each. Writes the text to
--out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_engine import chat  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import build_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402
from prism.testing.knobs import set_ops_knob  # noqa: E402

STEPS = 32
OUT: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    OUT.append(text)


def kernels_of(fn) -> tuple[list[dict], float]:
    """(the GPU kernels `fn` ran, each {name, ts, dur} in us, sorted by start; wall ms)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    kernels = [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(kernels, key=lambda k: k["ts"]), wall


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def idle_us(kernels: list[dict]) -> float:
    """Time inside [first start, last end] covered by no kernel."""
    idle, end = 0.0, None
    for k in kernels:
        if end is not None and k["ts"] > end:
            idle += k["ts"] - end
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    return idle


def by_name(kernels: list[dict]) -> dict[str, tuple[int, float]]:
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        row = table[short(k["name"])]
        row[0] += 1
        row[1] += k["dur"]
    return {name: (int(n), total) for name, (n, total) in table.items()}


def one_layer(kernels: list[dict], layers: int) -> list[str]:
    """The kernels of one layer in the middle of the run: from the middle, the next QKV-sized window."""
    per_step = len(kernels) // (STEPS + 1)
    per_layer = max(1, per_step // layers)
    start = len(kernels) // 2
    window = kernels[start:start + per_layer + 2]
    lines, prev_end = [], None
    for k in window:
        gap = 0.0 if prev_end is None else k["ts"] - prev_end
        lines.append(f"  gap {gap:7.2f} us  dur {k['dur']:7.2f} us  {short(k['name'])}")
        prev_end = k["ts"] + k["dur"]
    return lines


def profile_setting(llm: LLM, prompt_of, label: str, layers: int, batch: int) -> None:
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    many = SamplingParams.greedy(max_tokens=1 + STEPS, ignore_eos=True)
    def prompts(tag: str) -> list:
        return [prompt_of(f"{label} {tag} {i}") for i in range(batch)]

    for i in range(2):  # warm: the prompt's pages cached, every graph replayed once
        llm.generate(prompts(f"warm {i}"), many)
    # and the one-token run's own path: a compile in it made the step's wall time negative (session 18, batch 32)
    llm.generate(prompts("warm one"), one)
    k1, wall1 = kernels_of(lambda: llm.generate(prompts("one"), one))
    kn, walln = kernels_of(lambda: llm.generate(prompts("many"), many))
    t1, tn = by_name(k1), by_name(kn)
    say(f"\n=== {label}: wall per decode step {(walln - wall1) / STEPS:.3f} ms (under the profiler); "
        f"device idle per step {(idle_us(kn) - idle_us(k1)) / STEPS:.1f} us; "
        f"kernel time per step {(sum(k['dur'] for k in kn) - sum(k['dur'] for k in k1)) / STEPS:.1f} us")
    rows = []
    for name, (n, total) in tn.items():
        n0, total0 = t1.get(name, (0, 0.0))
        calls = (n - n0) / STEPS
        if calls <= 0:
            continue
        rows.append(((total - total0) / STEPS, calls, (total - total0) / max(1, n - n0), name))
    for per_step, calls, mean, name in sorted(rows, reverse=True):
        say(f"  {per_step:8.1f} us/step  {calls:6.1f} calls/step  {mean:7.2f} us each  {name}")
    say(f"  one layer, mid-run ({label}):")
    for line in one_layer(kn, layers):
        say(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="/tmp/prism-bench/qwen3vl-8b-random")
    parser.add_argument("--out", default="bench/results/profile-decode-step.txt")
    parser.add_argument("--kv", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pdl", default="both", choices=("both", "on", "off"))
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a launch knob of prism.ops.<module> for the profiled engines (repeatable)")
    args = parser.parse_args()
    for assignment in args.set:
        set_ops_knob(assignment)
        OUT.append(f"knob: {assignment}")
    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        build_checkpoint("8b", ckpt, device="cuda", progress=True)
    hot = random_images([(448, 448)] * 8, seed=7)
    for pdl in {"both": (False, True), "on": (True,), "off": (False,)}[args.pdl]:
        llm = LLM(ckpt, kv_dtype=args.kv, kv_memory_bytes=16 * 2**30, page_size=256, max_num_seqs=64,
                  max_num_batched_tokens=8192, programmatic_launch=pdl)
        layers = json.loads((ckpt / "config.json").read_text())["text_config"]["num_hidden_layers"]
        def prompt_of(question: str, prepare=llm.engine.inputs.prepare_chat):
            return prepare(chat(hot, question))

        profile_setting(llm, prompt_of, f"W3 batch {args.batch}, {args.kv} KV, PDL {'on' if pdl else 'off'}", layers,
                        args.batch)
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(OUT) + "\n")


if __name__ == "__main__":
    main()
