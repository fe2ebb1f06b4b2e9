"""Diagnose W4 (a cold 8-image request injected into 8 running decodes) on the GPU: run the W4 harness of
`bench_workloads.py` with the vision encoder's SDPA on cuDNN (torch's default on Hopper) and without it, in
the default and the interleaved mode, and print the slowest engine steps with what they computed and where
their time went (prepare, vision, decoder). `--timeline N ...`: instead, for interleave budgets N (`none` for the
default), the steps from ~16 before the cold request's first token to it, in order, without syncs (neither the
harness nor a server syncs between steps): each `step()` call's wall time (the device may still be running what
it launched), tokens computed, running requests and encoder calls. Not part of `nox -s bench`."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_workloads import CKPT, w4_injection  # noqa: E402

from prism.engine import engine as engine_mod  # noqa: E402
from prism.engine import runner as runner_mod  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

SMOKE = "--smoke" in sys.argv  # the harness on the CPU, tiny checkpoint


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()

STEPS: list[dict] = []


def timed(cls, name: str, key: str) -> None:
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        sync()
        t = time.perf_counter()
        out = fn(*a, **k)
        sync()
        if STEPS:
            STEPS[-1][key] = STEPS[-1].get(key, 0.0) + (time.perf_counter() - t) * 1e3
        return out

    setattr(cls, name, wrapper)


def run_w4(interleave: int | None) -> dict:
    if SMOKE:
        return w4_injection(ensure_tiny_checkpoint(), 64, 2, 2**26, interleave and 32)
    return w4_injection(CKPT, 448, 8, 12 * 2**30, interleave)


def timeline(budgets: list[int | None]) -> None:
    """Each step around the cold request, in order (see the module docstring)."""
    steps: list[dict] = []
    step = engine_mod.Engine.step

    def step_wrapper(self):
        rec = {"t": time.perf_counter(), "encodes": 0}
        steps.append(rec)
        out = step(self)
        rec["ms"] = (time.perf_counter() - rec["t"]) * 1e3
        rec["running"] = len(self.scheduler.running)
        rec["tokens"] = self.runner.stats.tokens_computed
        rec["cold"] = any(e.request_id == "cold" and e.new_token_ids for e in out)
        return out

    encode = runner_mod.ModelRunner._encode

    def counted_encode(*a, **k):
        if steps:
            steps[-1]["encodes"] += 1
        return encode(*a, **k)

    engine_mod.Engine.step, runner_mod.ModelRunner._encode = step_wrapper, counted_encode
    for interleave in budgets:
        steps.clear()
        r = run_w4(interleave)
        print(f"== interleave={interleave}: max ITL {r['max_itl_ms']:.1f} ms, cold TTFT {r['cold_ttft_ms']:.1f} ms, "
              f"alone {r['cold_alone_ttft_ms']:.1f} ms")
        prev = 0
        for s in steps:
            s["new"], prev = s["tokens"] - prev, s["tokens"]
        last = next(i for i, s in enumerate(steps) if s["cold"])
        t0 = steps[max(0, last - 16)]["t"]
        for s in steps[max(0, last - 16): last + 2]:
            print(f"  +{(s['t'] - t0) * 1e3:7.1f} ms  step {s['ms']:6.1f} ms  tokens "
                  f"{s['new']:5d}  running {s['running']}  encoder calls {s['encodes']}{'  <- cold first token' if s is steps[last] else ''}")
        sys.stdout.flush()


def main() -> None:
    if "--timeline" in sys.argv:
        args = sys.argv[sys.argv.index("--timeline") + 1:]
        timeline([None if a == "none" else int(a) for a in args if not a.startswith("--")])
        return
    step = engine_mod.Engine.step

    def step_wrapper(self):
        STEPS.append({"running": len(self.scheduler.running)})
        t = time.perf_counter()
        out = step(self)
        sync()
        STEPS[-1]["ms"] = (time.perf_counter() - t) * 1e3
        STEPS[-1]["tokens"] = self.runner.stats.tokens_computed
        return out

    engine_mod.Engine.step = step_wrapper
    timed(runner_mod.ModelRunner, "_encode", "vision_ms")
    timed(runner_mod.ModelRunner, "_forward", "eager_forward_ms")
    timed(runner_mod.ModelRunner, "_graph_step", "graph_ms")
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for interleave in (None,) if "--default-only" in sys.argv else (None, 256):
            STEPS.clear()
            r = run_w4(interleave)
            prev = 0
            for s in STEPS:
                s["new_tokens"], prev = s["tokens"] - prev, s["tokens"]
            slow = sorted(STEPS, key=lambda s: -s["ms"])[:6]
            print(f"== cudnn_sdp={cudnn} interleave={interleave}: max ITL {r['max_itl_ms']:.1f} ms, cold TTFT "
                  f"{r['cold_ttft_ms']:.1f} ms, alone {r['cold_alone_ttft_ms']:.1f} ms")
            for s in slow:
                print("   ", {k: round(v, 1) if isinstance(v, float) else v for k, v in s.items()})
            sys.stdout.flush()


if __name__ == "__main__":
    main()
