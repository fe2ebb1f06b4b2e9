"""Diagnose W4 (a cold 8-image request injected into 8 running decodes) on the GPU: run the W4 harness of
`bench_workloads.py` with the vision encoder's SDPA on cuDNN (torch's default on Hopper) and without it, in
the default and the interleaved mode, and print the slowest engine steps with what they computed and where
their time went (prepare, vision, decoder). `--timeline N ...`: instead, for interleave budgets N (`none` for the
default), the steps from ~16 before the cold request's first token to it, in order, without syncs (neither the
harness nor a server syncs between steps): each `step()` call's wall time (the device may still be running what
it launched), tokens computed, running requests and encoder calls; then the cold request's path on the host's
and the device's clocks (CUDA events: its preparation, its encoding ahead on the side stream, each step's end on
the main stream, its admission and first token). `--kernels` adds the profiler's kernel table over that span;
`--engine name=value ...` sets engine settings and `--side-priority N` the side stream's CUDA priority (A/Bs).
Each timeline step also shows the one-time costs it paid: Triton kernels compiled or loaded from the disk cache
(a variant the process had not launched yet) with their host time, the caching allocators' new device segments
and pinned host blocks, and the garbage collector's passes with theirs. `--gc-freeze`: `gc.freeze()` after each
engine's start (A/B). `--host-ops`: the profiler's table of host (CPU) time per op over the span, as `--kernels`;
`--cprofile`: cProfile's table of the engine's `step` calls over that span (Python functions, by own time).
Not part of `nox -s bench`."""

from __future__ import annotations

import cProfile
import functools
import gc
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_workloads import CKPT, w4_injection  # noqa: E402

from prism.engine import background_encoding as background_mod  # noqa: E402
from prism.engine import engine as engine_mod  # noqa: E402
from prism.engine import inputs as inputs_mod  # noqa: E402
from prism.engine import runner as runner_mod  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.gpu import record_first_launches  # noqa: E402
from prism.testing.knobs import parse_value  # noqa: E402

SMOKE = "--smoke" in sys.argv  # the harness on the CPU, tiny checkpoint
KERNELS = "--kernels" in sys.argv  # with --timeline: the kernels between the cold request's arrival and first token
HOST_OPS = "--host-ops" in sys.argv  # ... or the host's time per op over that span
CPROFILE = "--cprofile" in sys.argv  # ... and/or the Python functions of the engine's steps over that span


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


def option_values(flag: str) -> list[str]:
    """The command line's arguments after `flag`, up to the next option (none if `flag` is absent)."""
    if flag not in sys.argv:
        return []
    values = []
    for arg in sys.argv[sys.argv.index(flag) + 1:]:
        if arg.startswith("--"):
            break
        values.append(arg)
    return values


# `--engine name=value ...`: engine settings for an A/B of the timeline.
ENGINE_OVERRIDES = {name: parse_value(value) for name, value in (a.split("=", 1) for a in option_values("--engine"))}


def run_w4(interleave: int | None) -> dict:
    if SMOKE:
        return w4_injection(ensure_tiny_checkpoint(), 64, 2, 2**26, interleave and 32, **ENGINE_OVERRIDES)
    return w4_injection(CKPT, 448, 8, 12 * 2**30, interleave, **ENGINE_OVERRIDES)


def side_stream_priority(priority: int) -> None:
    """`--side-priority N`: the encoding ahead's stream at CUDA priority N (-1: high; torch's streams are 0)."""
    init = background_mod.BackgroundEncoding.__init__

    def with_priority(self, device, apart_from):
        init(self, device, apart_from)
        self.stream = torch.cuda.Stream(device, priority=priority)  # from another pool than the capture streams
        assert all(self.stream != other for other in apart_from)

    background_mod.BackgroundEncoding.__init__ = with_priority


class DeviceClock:
    """Device times of CUDA events on the host's clock: one host sync when the decodes are added (before the cold
    request, so the measured span has none), then each event's time is that sync's host time plus its elapsed
    time from an event recorded right after it."""

    def __init__(self) -> None:
        self.ref: torch.cuda.Event | None = None
        self.host = 0.0
        self.marks: list[tuple[str, torch.cuda.Event | float]] = []

    def start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.host = time.perf_counter()
        self.marks.clear()

    def device(self, label: str, stream=None) -> None:
        """Mark when the device reaches this point of `stream` (default: the current one)."""
        if self.ref is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self.marks.append((label, event))

    def host_mark(self, label: str) -> None:
        self.marks.append((label, time.perf_counter()))

    def resolved(self) -> list[tuple[float, str]]:
        sync()
        out = []
        for label, mark in self.marks:
            t = mark if isinstance(mark, float) else self.host + self.ref.elapsed_time(mark) / 1e3
            out.append((t, label))
        return sorted(out)


def count_collections(record: Callable[[int, float], None]) -> None:
    """Report each garbage-collector pass (its generation and host time)."""
    started = {}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            record(info["generation"], (time.perf_counter() - started.pop("t")) * 1e3)

    gc.callbacks.append(callback)


def new_segments() -> int:
    """The caching allocator's device segments so far (each a cudaMalloc)."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


def pinned_allocations() -> tuple[int, float]:
    """The pinned host allocator's new blocks so far (each a cudaHostAlloc) and their host time in ms."""
    if not torch.cuda.is_available():
        return 0, 0.0
    stats = torch.cuda.host_memory_stats()
    return stats.get("num_host_alloc", 0), stats.get("host_alloc_time.total", 0) / 1e3


def timeline(budgets: list[int | None]) -> None:
    """Each step around the cold request, in order (see the module docstring), then the cold request's path on the
    host's and the device's clocks: arrival, prepared, its encoding ahead (launched, begun and ended on the side
    stream), each step's start on the main stream (the device reaching work queued at the step's entry, i.e. the
    end of what was queued before), its admission and its first token."""
    steps: list[dict] = []
    clock = DeviceClock()
    profiler = {"prof": None, "done": False}  # --kernels: the device's kernels from the cold request's admission
    step = engine_mod.Engine.step

    def first_launch(name: str, ms: float) -> None:
        if steps:
            steps[-1]["first_launches"].append(f"{name} {ms:.1f} ms")

    if torch.cuda.is_available():
        record_first_launches(first_launch)  # for the process's life

    def collection(generation: int, ms: float) -> None:
        if steps:
            steps[-1]["collections"].append(f"gen{generation} {ms:.1f} ms")

    count_collections(collection)
    python_profile = cProfile.Profile()

    def step_wrapper(self):
        rec = {"t": time.perf_counter(), "encodes": 0, "first_launches": [], "collections": [], "segments": new_segments(),
               "pinned": pinned_allocations()}
        steps.append(rec)
        cold = self.requests.get("cold")
        in_span = cold is not None and cold.times.first_token is None
        if in_span:
            clock.device(f"step {len(steps)} device start")
            clock.host_mark(f"step {len(steps)} host entry")
        if in_span and CPROFILE:
            python_profile.enable()
        out = step(self)
        if in_span and CPROFILE:
            python_profile.disable()
        rec["ms"] = (time.perf_counter() - rec["t"]) * 1e3
        rec["segments"] = new_segments() - rec["segments"]
        count, ms = pinned_allocations()
        rec["pinned"] = (count - rec["pinned"][0], ms - rec["pinned"][1])
        rec["running"] = len(self.scheduler.running)
        rec["tokens"] = self.runner.stats.tokens_computed
        rec["cold"] = any(e.request_id == "cold" and e.new_token_ids for e in out)
        if rec["cold"] and not any(label.startswith("cold first token") for label, _ in clock.marks):
            if profiler["prof"] is not None and not profiler["done"]:
                profiler["prof"].stop()
                profiler["done"] = True
            clock.host_mark(f"cold first token (step {len(steps)} returned)")
            clock.marks.append(("cold first scheduled (host)", cold.times.first_scheduled))
        return out

    encode = runner_mod.ModelRunner._encode

    def counted_encode(*a, **k):
        if steps:
            steps[-1]["encodes"] += 1
        return encode(*a, **k)

    background_run = background_mod.BackgroundEncoding.run

    def marked_background_run(self, encode_fn):
        clock.host_mark("encoding ahead launched (host)")

        def marked():
            clock.device("encoding ahead begins (side stream)", self.stream)
            features = encode_fn()
            clock.device("encoding ahead ends (side stream)", self.stream)
            return features

        return background_run(self, marked)

    prepare_chat = inputs_mod.InputProcessor.prepare_chat

    def marked_prepare_chat(self, *a, **k):
        clock.host_mark(f"preparation begins ({threading.current_thread().name})")
        return prepare_chat(self, *a, **k)

    add_request = engine_mod.Engine.add_request

    def marked_add_request(self, request_id, *a, **k):
        if request_id == "long0":
            clock.start()
        if request_id == "cold":
            clock.host_mark("cold added (prepared)")
            if (KERNELS or HOST_OPS) and profiler["prof"] is None:
                activity = torch.profiler.ProfilerActivity
                profiler["prof"] = torch.profiler.profile(
                    activities=[activity.CUDA if torch.cuda.is_available() and not HOST_OPS else activity.CPU])
                profiler["prof"].start()
        return add_request(self, request_id, *a, **k)

    engine_mod.Engine.step, runner_mod.ModelRunner._encode = step_wrapper, counted_encode
    background_mod.BackgroundEncoding.run = marked_background_run
    engine_mod.Engine.add_request = marked_add_request
    inputs_mod.InputProcessor.prepare_chat = marked_prepare_chat
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
                  f"{s['new']:5d}  running {s['running']}  encoder calls {s['encodes']}"
                  f"{'  <- cold first token' if s is steps[last] else ''}"
                  f"{'  new segments ' + str(s['segments']) if s['segments'] else ''}"
                  f"{'  new pinned blocks {} ({:.1f} ms)'.format(*s['pinned']) if s['pinned'][0] else ''}"
                  f"{'  first launches: ' + ', '.join(s['first_launches']) if s['first_launches'] else ''}"
                  f"{'  gc: ' + ', '.join(s['collections']) if s['collections'] else ''}")
        marks = clock.resolved()
        # The harness times the first token when `step` returns it, as the mark does: arrival = that - TTFT.
        first = next(t for t, label in marks if label.startswith("cold first token"))
        arrival = first - r["cold_ttft_ms"] / 1e3
        print("  the cold request's path (ms from its arrival; device marks on the host's clock):")
        for t, label in marks:
            print(f"    {(t - arrival) * 1e3:+8.1f}  {label}")
        if profiler["prof"] is not None:
            what = "host time per op" if HOST_OPS else "kernels"
            print(f"  {what} from the cold request's arrival to its first token (all streams; the profiler slows the "
                  "host, so this run's times above are not the harness's):")
            sort_by = "cuda_time_total" if torch.cuda.is_available() and not HOST_OPS else "self_cpu_time_total"
            print(profiler["prof"].key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=90))
            profiler["prof"], profiler["done"] = None, False
        if CPROFILE:
            print("  the engine's steps from the cold request's addition to its first token, Python functions by own time "
                  "(cProfile slows the host: this run's times above are not the harness's):")
            pstats.Stats(python_profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)
            python_profile = cProfile.Profile()
        sys.stdout.flush()


def freeze_after_start() -> None:
    """`--gc-freeze`: each engine's objects, once it has started, moved out of the collector's generations."""
    init = engine_mod.Engine.__init__

    def frozen(self, *a, **k):
        init(self, *a, **k)
        gc.collect()
        gc.freeze()

    engine_mod.Engine.__init__ = frozen


def main() -> None:
    if "--gc-freeze" in sys.argv:
        freeze_after_start()
    if "--side-priority" in sys.argv:
        side_stream_priority(int(sys.argv[sys.argv.index("--side-priority") + 1]))
    if "--timeline" in sys.argv:
        timeline([None if arg == "none" else int(arg) for arg in option_values("--timeline")])
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
