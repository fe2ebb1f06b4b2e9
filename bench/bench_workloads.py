"""GPU benchmark, in-process: W4 (a cold 8-image request injected into running decodes) and W5 (clients over a
Zipf working set of image groups, scaled-FP8 vs BF16 KV under the same fixed KV budget), on the 8B-shaped
checkpoint built by bench_engine.py. `--smoke` runs a tiny version on the CPU (tiny checkpoint) to check the
harness. Each row is the median run by its headline figure, with the range, of one process, or of `W5_PROCESSES` for
W5's rows (their spread is larger than their margin), or of `--repeat N` for every row. W5's figures are those of the
steady state (its second 256 requests; the first ones' beside them). `--select A,B` runs the named workloads only
(the W5 rows without async admissions run only when selected). Writes
bench/results/<date>-<gpu>-workloads[-selection].json/.md.

Each workload runs in a process of its own (`--only NAME` prints its result as JSON), and this one never initializes
CUDA. H200, session 12, same code: W5's FP8 engine served 54 req/s measured after the three W4 engines in one
process, 56 in a process of its own started by a parent that held a CUDA context, and 66-74 in processes started
alone (four runs); BF16 served ~51 in every arrangement. Session 13: 67-69 with this harness and 45.7 in another
process at Python's 5 ms GIL switch interval; 79.4 (this harness) and 82.2 (another process) once the engine set it to
0.5 ms (`python_switch_interval_ms`). FP8's W5 is host-bound, its step loop sharing the GIL with 8 preparation
threads: consistent with the 5 ms hand-offs causing the spread, one run per arrangement.

No device sync between the steps of a workload (a server has none): W4's gaps are those a client would see."""

from __future__ import annotations

import datetime
import gc
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from results_io import write_results  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.request import FinishReason  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

CKPT = Path("/tmp/prism-bench/qwen3vl-8b-random")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def chat(images, text: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def w4_injection(ckpt: Path, size: int, n_images: int, kv_bytes: int, interleave: int | None = None,
                 beside: bool | None = None, **overrides) -> dict:
    """8 long decodes run; a cold request with `n_images` new images arrives: the running streams' token gaps.
    `interleave`: the engine's interleave_prefill_tokens (None: the default); `beside`: its
    `encode_ahead_beside_decodes` (None: the default, on with interleaving); `overrides`: other engine settings
    (A/B runs). Also measures, first, the
    same kind of cold request alone on this engine (its TTFT, preparation included, is the W1 baseline of the
    ratio)."""
    llm = LLM(ckpt, kv_memory_bytes=kv_bytes, page_size=256 if size >= 448 else 16,
              interleave_prefill_tokens=interleave, encode_ahead_beside_decodes=beside, **overrides)
    engine = llm.engine
    alone = []
    one = SamplingParams.greedy(max_tokens=1, ignore_eos=True)
    for seed in (90, 91, 92):  # the first warms up
        messages = chat(random_images([(size, size)] * n_images, seed=seed), "Describe all.")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()  # preparation included, as in W1 and as for the injected request below
        llm.generate([engine.inputs.prepare_chat(messages)], one)
        alone.append(time.perf_counter() - t)
    for i in range(8):
        engine.add_request(f"long{i}", f"Tell a very long story, number {i}.",
                           SamplingParams.greedy(max_tokens=400, ignore_eos=True))
    last: dict[str, float] = {}
    gaps: list[float] = []
    cold_arrival = cold_ttft = None
    cold_tokens: list[int] = []
    preparing = None
    steps = 0
    media_pool = ThreadPoolExecutor(1)
    cold_messages = chat(random_images([(size, size)] * n_images, seed=5), "Describe all.")
    while engine.has_unfinished_requests() or preparing is not None:
        if steps == 40:  # the decodes are in steady state: the cold request arrives
            # Prepared beside the engine loop, as the server's media pool does; part of its TTFT, as in W1.
            cold_arrival = time.perf_counter()
            preparing = media_pool.submit(engine.inputs.prepare_chat, cold_messages)
        if preparing is not None and preparing.done():
            engine.add_request("cold", preparing.result(), SamplingParams.greedy(max_tokens=4, ignore_eos=True))
            preparing = None
        # No device sync between steps (a server has none): a token counts when `step` hands it over.
        for event in engine.step():
            now = time.perf_counter()
            if event.request_id == "cold":
                if cold_ttft is None and event.new_token_ids:
                    cold_ttft = now - cold_arrival
                cold_tokens += event.new_token_ids
                continue
            if event.new_token_ids:
                if event.request_id in last and steps >= 35:
                    gaps.append(now - last[event.request_id])
                last[event.request_id] = now
        steps += 1
    cold_ms = (cold_ttft or float("nan")) * 1e3
    alone_ms = min(alone[1:]) * 1e3
    # A sanity check, not a parity test: the same cold request alone, with nothing cached, gives the same greedy
    # tokens (in bf16 a chunked prefill beside decodes may part at a near-tie; the JSON keeps both).
    engine.kv.clear_cache()
    engine.runner.encoder_cache.clear()
    alone_tokens = llm.generate([engine.inputs.prepare_chat(cold_messages)],
                                SamplingParams.greedy(max_tokens=4, ignore_eos=True))[0].token_ids
    return {"interleave_prefill_tokens": interleave,
            "encode_ahead_beside_decodes": llm.engine.config.encodes_ahead_beside_decodes,
            "async_chunk_steps": engine.stats.async_chunk_steps,
            "gil_switch_interval_ms": sys.getswitchinterval() * 1e3,
            "max_itl_ms": max(gaps) * 1e3, "p95_itl_ms": pct(gaps, 0.95) * 1e3,
            "median_itl_ms": pct(gaps, 0.5) * 1e3, "cold_ttft_ms": cold_ms, "cold_alone_ttft_ms": alone_ms,
            "cold_ttft_over_alone": cold_ms / alone_ms, "cold_tokens": cold_tokens, "cold_alone_tokens": alone_tokens,
            "cold_tokens_equal_alone": cold_tokens == alone_tokens, "gaps_ms": [g * 1e3 for g in gaps]}


def w5_working_set(ckpt: Path, kv_dtype: str, kv_bytes: int, size: int, groups: int, clients: int, requests: int,
                   warm_requests: int = 0, **overrides) -> dict:
    """`clients` requests in flight at all times over `groups` image sets with Zipf(1.1) popularity. The figures are
    those of the `requests` requests after the first `warm_requests` (the steady state: the cache holds the working
    set as its budget allows, every kernel variant has been launched); the first ones' figures are under
    `from_start`. `overrides`: other engine settings (`host_w5.py` runs it on the tiny checkpoint with the pool of the
    8B's pages)."""
    llm = LLM(ckpt, **{"kv_dtype": kv_dtype, "kv_memory_bytes": kv_bytes, "page_size": 256 if size >= 448 else 16,
                       "max_num_seqs": clients, **overrides})
    engine = llm.engine
    kv = engine.kv
    rng = random.Random(0)
    weights = [1 / (k + 1) ** 1.1 for k in range(groups)]
    image_sets = [random_images([(size, size)] * 4, seed=1000 + g) for g in range(groups)]
    # Each client's input is prepared beside the engine loop (as the server's media pool does), and its TTFT
    # counts from its submission, preparation included.
    media_pool = ThreadPoolExecutor(8)
    preparing: dict[str, object] = {}
    arrivals: dict[str, float] = {}
    ttft: dict[int, float] = {}  # by submission index
    submitted = finished = steps = 0
    total = warm_requests + requests

    def snapshot() -> tuple:
        return time.perf_counter(), steps, kv.stats.hit_tokens, kv.stats.queries_tokens, kv.entries.evictions

    def submit() -> None:
        nonlocal submitted
        group = rng.choices(range(groups), weights)[0]
        request_id = f"w5-{submitted}"
        arrivals[request_id] = time.perf_counter()
        preparing[request_id] = media_pool.submit(
            engine.inputs.prepare_chat, chat(image_sets[group], f"Question {submitted} about set {group}?"))
        submitted += 1

    marks = {"start": snapshot()}
    while finished < total:
        while submitted - finished < clients and submitted < total:
            submit()
        for request_id in [r for r, f in preparing.items() if f.done()]:
            engine.add_request(request_id, preparing.pop(request_id).result(),
                               SamplingParams.greedy(max_tokens=16, ignore_eos=True))
        if not engine.has_unfinished_requests():
            time.sleep(0.0005)  # every request is still being prepared
            continue
        steps += 1
        for event in engine.step():
            if event.new_token_ids and event.request_id in arrivals:
                ttft[int(event.request_id[3:])] = time.perf_counter() - arrivals.pop(event.request_id)
            if event.finished:
                if event.finish_reason is FinishReason.ERROR:  # a failed request is no throughput
                    raise RuntimeError(f"W5 request {event.request_id} failed: {event.error}")
                finished += 1
                if finished == warm_requests:
                    marks["warm"] = snapshot()
    marks["end"] = snapshot()
    media_pool.shutdown()

    def phase(begin: tuple, end: tuple, count: int, indices: range) -> dict:
        times = [ttft[i] for i in indices]
        return {"requests": count, "req_per_s": count / (end[0] - begin[0]), "ttft_p50_ms": pct(times, 0.5) * 1e3,
                "ttft_p99_ms": pct(times, 0.99) * 1e3, "hit_rate": (end[2] - begin[2]) / max(end[3] - begin[3], 1),
                "evictions": end[4] - begin[4], "steps": end[1] - begin[1]}

    result = phase(marks.get("warm", marks["start"]), marks["end"], requests, range(warm_requests, total))
    if warm_requests:
        result["from_start"] = phase(marks["start"], marks["warm"], warm_requests, range(warm_requests))
    return {**result, "warm_requests": warm_requests, "pool_pages": kv.gpu.num_pages,
            "async_steps": engine.stats.async_steps, "scheduled_ahead_steps": engine.stats.scheduled_ahead_steps,
            "async_admissions": engine.config.async_admissions}


def w4_second_run(ckpt: Path, size: int, n_images: int, kv_bytes: int) -> dict:
    """W4 default twice in one process (a new engine each time), the second run's result with the first's figures
    beside it. A process's first injected prefill step is the slow one (H200, session 21: its host launch, which
    sets the decodes' longest gap, took 42-71 ms in first runs against 22-41 in second runs; cuBLAS's first uses
    of kernels are part of it): the harness's `W4` row is a first run, as a server's first such step is."""
    first = w4_injection(ckpt, size, n_images, kv_bytes)
    gc.collect()
    second = w4_injection(ckpt, size, n_images, kv_bytes)
    return {**second, "first_run_max_itl_ms": first["max_itl_ms"], "first_run_cold_ttft_ms": first["cold_ttft_ms"]}


def workloads(smoke: bool) -> dict:
    """Name -> a call that measures it (the W4 modes, W5 per KV format)."""
    if smoke:
        ckpt, size, kv_w5, kv_w4, groups, clients, requests = ensure_tiny_checkpoint(), 64, 2 * 2**20, 16 * 2**20, 6, 8, 40
    else:
        ckpt, size, kv_w5, kv_w4, groups, clients, requests = CKPT, 448, 3 * 2**30, 16 * 2**30, 32, 32, 256
    # W5's figures are its second `requests` requests': its first ones fill the cache and launch every kernel
    # variant for the first time (session 15: one variant's compile took 0.66 s of W5's first steps).
    w5 = {"groups": groups, "clients": clients, "kv_bytes": kv_w5}

    def w5_run(kv_dtype: str, **overrides) -> dict:
        return {**w5, **w5_working_set(ckpt, kv_dtype, kv_w5, size, groups, clients, requests,
                                       warm_requests=requests, **overrides)}

    return {"W4": lambda: w4_injection(ckpt, size, 8, kv_w4),
            "W4_second_run": lambda: w4_second_run(ckpt, size, 8, kv_w4),
            "W4_interleave_256": lambda: w4_injection(ckpt, size, 8, kv_w4, interleave=256),
            "W4_interleave_512": lambda: w4_injection(ckpt, size, 8, kv_w4, interleave=512),
            "W4_interleave_640": lambda: w4_injection(ckpt, size, 8, kv_w4, interleave=640),
            "W5_fp8": lambda: w5_run("fp8"),
            "W5_bf16": lambda: w5_run("bf16"),
            # without async admissions (on by default since session 15): each step that admits a waiting request
            # is scheduled after the previous one's tokens are read. Not run unless selected.
            "W5_fp8_no_admissions": lambda: w5_run("fp8", async_admissions=False),
            "W5_bf16_no_admissions": lambda: w5_run("bf16", async_admissions=False)}


# the workloads `main` runs unless `--select` names others
DEFAULT_WORKLOADS = ["W4", "W4_second_run", "W4_interleave_256", "W4_interleave_512", "W4_interleave_640", "W5_fp8",
                     "W5_bf16"]


_RESULT = "WORKLOAD RESULT "  # marks the child's result line among whatever else it prints


def run_isolated(name: str, smoke: bool) -> dict:
    """One workload in a fresh Python process; its result is the line it prints after `_RESULT`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--only", name] + (["--smoke"] if smoke else [])
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if len(lines) != 1:
        raise RuntimeError(f"workload {name} printed {len(lines)} result lines; its output:\n{done.stdout}")
    return json.loads(lines[0][len(_RESULT):])


def headline(result: dict) -> float:
    """The figure a workload's runs are ranked by: W4's TTFT ratio, W5's req/s."""
    return result["cold_ttft_over_alone"] if "cold_ttft_over_alone" in result else result["req_per_s"]


def median_run(runs: list[dict]) -> dict:
    """The run with the median headline figure (of an even count, the worse middle one: the higher W4 ratio, the
    lower W5 req/s; `--repeat N`: one process each), every run's figure beside it: on the H200 the same W4 request
    alone ranged 64.6-72.2 ms over four processes of one machine (session 14)."""
    ranked = sorted(runs, key=headline)
    worse_is_higher = "cold_ttft_over_alone" in ranked[0]
    return {**ranked[len(ranked) // 2 if worse_is_higher else (len(ranked) - 1) // 2],
            "headline_of_runs": [headline(r) for r in runs]}


# W5 is host-bound and its figure spreads more than its margin: on one H200 machine, the same code served 70.6, 101.3,
# 87.1 and 105.3 FP8 req/s in four processes and 66.2, 74.4 and 68.1 BF16 (session 27), so one FP8 process against one
# BF16 process gave anything from 0.95x to 1.59x. Its rows are each the median of this many processes by default.
W5_PROCESSES = 3


def processes_of(name: str, repeat: int | None) -> int:
    """How many processes a workload's row is the median of: `--repeat N` for every row, else W5_PROCESSES for W5's
    rows and one for the others."""
    if repeat is not None:
        return repeat
    return W5_PROCESSES if name.startswith("W5") else 1


def run_rounds(names: list[str], repeat: int | None, smoke: bool, run=None) -> dict[str, list[dict]]:
    """Every workload's runs, one process each, in rounds: each round runs every workload that still needs a run, in
    order, so the rows compared in a ratio (W5's FP8 and BF16) alternate and share the machine's drift."""
    run = run or run_isolated
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(max(processes_of(name, repeat) for name in names)):
        for name in names:
            if round_ < processes_of(name, repeat):
                runs[name].append(run(name, smoke))
    return runs


def spread(result: dict, fmt: str) -> str:
    """' (lowest-highest over N runs)' when a workload ran more than once."""
    values = result.get("headline_of_runs", [])
    return f" ({fmt.format(min(values))}-{fmt.format(max(values))} over {len(values)})" if len(values) > 1 else ""


def w4_table(out: dict) -> list[str]:
    rows = [(label, out[name]) for label, name in (
        ("default", "W4"), ("default, second run of its process", "W4_second_run"),
        ("interleave 256", "W4_interleave_256"), ("interleave 512", "W4_interleave_512"),
        ("interleave 640", "W4_interleave_640")) if name in out]
    if not rows:
        return []
    return [
        "W4: 8 running decodes, a cold 8-image request injected (targets: max ITL <= 70 ms by default; interleaving "
        "<= 20 ms with cold TTFT <= 1.3x the same request alone)",
        "",
        "The default runs in a fresh process, as every row does; its second row is a second W4 run in one process",
        "(a process's first injected prefill step pays one-time costs on the host: bench/NOTES.md, session 21).",
        "Interleave rows: `interleave_prefill_tokens` N (its media encoded beside the decodes, as that mode does by",
        "default); chunks ahead: chunk steps launched while the previous step ran (async scheduling). The last column",
        "compares the cold request's greedy tokens with the same request's alone and uncached (a sanity check: a",
        "chunked bf16 prefill may part from the whole one at a near-tie).",
        "",
        "| mode | max ITL | p95 ITL | median ITL | cold TTFT | same request alone | ratio | chunks ahead | tokens = alone |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *(f"| {label} | {r['max_itl_ms']:.1f} ms | {r['p95_itl_ms']:.1f} ms | {r['median_itl_ms']:.1f} ms | "
          f"{r['cold_ttft_ms']:.1f} ms | {r['cold_alone_ttft_ms']:.1f} ms | {r['cold_ttft_over_alone']:.2f}x"
          f"{spread(r, '{:.2f}')} | "
          f"{r.get('async_chunk_steps', 0)} | {'yes' if r['cold_tokens_equal_alone'] else 'NO'} |"
          for label, r in rows),
        "",
    ]


def w5_table(out: dict) -> list[str]:
    rows = [(label, out[name]) for label, name in (
        ("scaled FP8", "W5_fp8"), ("BF16", "W5_bf16"), ("scaled FP8, no async admissions", "W5_fp8_no_admissions"),
        ("BF16, no async admissions", "W5_bf16_no_admissions")) if name in out]
    if not rows:
        return []
    first = rows[0][1]

    def row(label: str, r: dict) -> str:
        return (f"| {label} | {r['pool_pages']} | {r['req_per_s']:.2f}{spread(r, '{:.1f}')} | {r['ttft_p50_ms']:.1f} ms "
                f"| {r['ttft_p99_ms']:.1f} ms | {r['hit_rate']:.1%} | {r['evictions']} | {r['steps']} |")

    def from_start(label: str, r: dict) -> str:
        return row(f"{label}, first {r['warm_requests']}", {**r, **r["from_start"], "headline_of_runs": []})

    lines = [
        f"W5: {first['clients']} clients, {first['groups']} image groups (4 images each), Zipf 1.1, same KV budget "
        f"({first['kv_bytes'] / 2**30:.2f} GiB). Each row: {first['requests']} requests after the first "
        f"{first['warm_requests']} (the steady state), the median of its processes by req/s; below, the same processes'"
        f" first {first['warm_requests']} (from the engine's start: the cache fills, kernels launch the first time).",
        "",
        "| KV | pool pages | req/s | TTFT p50 | TTFT p99 | prefix hit rate | evictions | steps |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(row(label, r) for label, r in rows),
        *(from_start(label, r) for label, r in rows if "from_start" in r),
        "",
    ]
    for fp8_name, bf16_name, what in (("W5_fp8", "W5_bf16", ""),
                                      ("W5_fp8_no_admissions", "W5_bf16_no_admissions", ", no async admissions")):
        if fp8_name in out and bf16_name in out:
            f8, b16 = out[fp8_name], out[bf16_name]
            lines.append(f"FP8 / BF16 req/s{what} (the rows' medians): {f8['req_per_s'] / b16['req_per_s']:.2f}x "
                         f"(target >= 1.3x with a higher hit rate: {f8['hit_rate']:.1%} vs {b16['hit_rate']:.1%})")
    return lines


def main() -> None:
    smoke = "--smoke" in sys.argv
    if "--only" in sys.argv:
        name = sys.argv[sys.argv.index("--only") + 1]
        result = workloads(smoke)[name]()
        print(_RESULT + json.dumps({**result, "gpu": "cpu-smoke" if smoke else torch.cuda.get_device_name()}))
        return
    names = DEFAULT_WORKLOADS
    if "--select" in sys.argv:  # a comma-separated list of workload names
        names = sys.argv[sys.argv.index("--select") + 1].split(",")
        unknown = sorted(set(names) - set(workloads(smoke)))
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; known: {sorted(workloads(smoke))}")
    if not smoke and not (CKPT / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "make_checkpoint.py"), "--ckpt", str(CKPT)], check=True)
    # This process never touches CUDA (the device's name comes from the workloads' processes).
    repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else None
    if repeat is not None and repeat < 1:
        raise SystemExit(f"--repeat needs a positive count, got {repeat}")
    results = {name: median_run(runs) for name, runs in run_rounds(names, repeat, smoke).items()}
    gpu = next(iter(results.values())).get("gpu", "unknown")
    out = {"gpu": gpu, "date": datetime.date.today().isoformat(), **results}
    md = "\n".join([f"W4/W5, {gpu}, {out['date']}", "", *w4_table(out), *w5_table(out)]) + "\n"
    print(md)
    if not smoke:
        write_results(out, md, gpu, out["date"], "workloads" if names == DEFAULT_WORKLOADS else
                      "workloads-" + "-".join(name.lower() for name in names))

if __name__ == "__main__":
    main()
