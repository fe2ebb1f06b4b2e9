"""GPU benchmark in `vllm bench serve`'s terms, over HTTP as deployed: the server in a process of its own (`prism
serve`), N concurrent clients streaming chat completions through the official `openai` client, each request about
one of a few image groups (the mission's workload: many independent requests over the same images, a new question
each time; the images named by `uuid` after each group was sent once, vLLM's convention).

Per request: TTFT (to the first streamed token: the requests ask for logprobs, so that each token streams a chunk
even when its text is empty, as a random model's often is; vLLM's tool counts chunks with text), TPOT (the time after the first token over the tokens after it,
usage's `completion_tokens`), ITL (every gap between streamed contents, pooled over requests) and E2E latency;
reported as mean / median / p99 (numpy's linear percentile, as vLLM), with request, output-token and total-token
throughput over the measured run. The same requests run against the FP8 KV config and a BF16 KV copy of it, each
server in a fresh process (`--fp8-only` / `--bf16-only`: one of them). `--smoke`: the tiny checkpoint on the CPU (the
harness, not a measurement).
Writes bench/results/<date>-<gpu>-serve.json/.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench_http import data_urls, image_message  # noqa: E402
from results_io import write_results  # noqa: E402

CKPT = Path("/tmp/prism-bench/qwen3vl-8b-random")
CONFIG = ROOT / "configs" / "tp1_fp8.json"
MODEL = "qwen3-vl-8b-random"


@dataclass(frozen=True)
class Load:
    """What the clients send: `num_prompts` requests, at most `concurrency` in flight, each about one of `groups`
    image groups of `images_per_group` pictures drawn Zipf(`zipf_s`), asking for `output_tokens` tokens, after
    `warm_requests` like them that are not measured."""

    num_prompts: int = 256
    concurrency: int = 32
    groups: int = 8
    images_per_group: int = 4
    image_size: int = 448
    zipf_s: float = 1.1
    output_tokens: int = 64
    warm_requests: int = 64  # sent first, not measured
    clients: int = 4  # processes of clients, `concurrency / clients` streams each: one could not keep up
    seed: int = 0


SMOKE = Load(num_prompts=12, concurrency=4, groups=2, images_per_group=1, image_size=64, output_tokens=6,
             warm_requests=4, clients=2)


@dataclass
class RequestRecord:
    """One streamed request as its client saw it (seconds)."""

    ttft: float
    e2e: float
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


def serve_metrics(records: list[RequestRecord], duration_s: float) -> dict:
    """`vllm bench serve`'s figures from the requests of one run: TPOT excludes the first token (a request of one
    token has none); ITLs are pooled over requests."""
    if not records or duration_s <= 0:
        raise ValueError(f"no completed requests to report ({len(records)} in {duration_s} s)")

    def stats(name: str, seconds: list[float]) -> dict:
        values = np.asarray(seconds, dtype=np.float64) * 1e3
        if values.size == 0:
            return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
        return {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
                f"p99_{name}_ms": float(np.percentile(values, 99))}

    output = sum(r.output_tokens for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    return {
        "completed": len(records), "duration_s": duration_s,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(records) / duration_s,
        "output_token_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        **stats("ttft", [r.ttft for r in records]),
        **stats("tpot", tpots),
        **stats("itl", [gap for r in records for gap in r.itls]),
        **stats("e2el", [r.e2e for r in records]),
    }


def zipf_groups(load: Load) -> list[int]:
    """The image group of each request: Zipf(s) over the groups, the first most asked about."""
    rng = np.random.default_rng(load.seed)
    weights = 1.0 / np.arange(1, load.groups + 1) ** load.zipf_s
    return [int(g) for g in rng.choice(load.groups, size=load.num_prompts, p=weights / weights.sum())]


def group_images(load: Load) -> list[list[str]]:
    return [data_urls(1000 + g, load.images_per_group, load.image_size) for g in range(load.groups)]


def messages(urls: list[str], group: int, text: str, send: bool) -> list[dict]:
    return image_message(urls, text, [f"serve-g{group}-{i}" for i in range(len(urls))], send)


class ServerProcess:
    """`prism serve` on a free local port, in its own process; started and waited for (its /health answering 200)
    on entry, stopped (SIGTERM) on exit."""

    def __init__(self, model: Path | None, config: Path, log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "prism.cli", "serve", "--config", str(config), "--port", str(self.port),
                        "--served-model-name", MODEL, "--log-level", "warning"]
        if model is not None:
            self.command += ["--model", str(model)]
        self.log = log

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                           if p)}
        self.log_file = self.log.open("w")
        self.process = subprocess.Popen(self.command, env=env, stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the server did not answer /health within 600 s: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log_file.close()


def run_load(url: str, load: Load, groups: list[list[str]], progress: bool) -> dict:
    """Each group sent once with its pixels (not measured), then `load.clients` processes of clients: each sends its
    share of the warm-up requests, waits for the others (a barrier), then its share of the measured ones, at most
    `concurrency / clients` in flight. One process of `openai` clients was the bottleneck: on the CPU machine with the
    model stubbed it spent 85% of a core parsing chunks, and its TTFT read 245 ms where the server's own histogram
    read 43. Also reported, from the server's /metrics over the measured requests: its mean TTFT (and its parts) and
    ITL, its prefix-cache hit rate, the media its vision encoder ran and its preemptions."""
    from openai import OpenAI
    from tqdm import tqdm

    with OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) as client:
        for g, urls in enumerate(groups):
            client.chat.completions.create(model=MODEL, messages=messages(urls, g, "Warm up.", send=True),
                                           max_tokens=1)
    ctx = multiprocessing.get_context("spawn")
    barrier, done, results = ctx.Barrier(load.clients + 1), ctx.Value("i", 0), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url, load, groups, k, barrier, done, results), daemon=True)
               for k in range(load.clients)]
    for worker in workers:
        worker.start()
    barrier.wait(timeout=600)  # every client's warm-up answered: the measured run starts
    before = server_series(url)
    with tqdm(total=load.num_prompts, desc="requests", disable=not progress) as bar:
        shares = []
        while len(shares) < load.clients:
            try:
                shares.append(results.get(timeout=0.5))
            except queue.Empty:
                if not all(w.is_alive() for w in workers) and results.empty():
                    raise RuntimeError("a client process died: " + ", ".join(
                        f"exit code {w.exitcode}" for w in workers if not w.is_alive())) from None
            bar.update(done.value - bar.n)
    after = server_series(url)
    for worker in workers:
        worker.join(timeout=60)
    failures = [share for share in shares if isinstance(share, str)]
    if failures:
        raise RuntimeError(f"a client process failed: {failures[0]}")
    records = [RequestRecord(**r) for share in shares for r in share[2]]
    duration = max(share[1] for share in shares) - min(share[0] for share in shares)
    return serve_metrics(records, duration) | server_figures(before, after)


# The server's series read before and after the measured run: histograms as (sum, count), counters as a value.
SERVER_HISTOGRAMS = {"ttft": "time_to_first_token", "itl": "inter_token_latency",
                     "preparation": "request_preparation_time", "queue": "request_queue_time",
                     "prefill": "request_prefill_time"}
SERVER_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "vision_encoder_items", "num_preemptions")


def server_series(url: str) -> dict[str, float]:
    """The `prism:` series of SERVER_HISTOGRAMS (`<name>_sum`, `<name>_count`) and SERVER_COUNTERS from /metrics."""
    wanted = {f"prism:{name}_seconds_{part}": f"{name}_{part}" for name in SERVER_HISTOGRAMS.values()
              for part in ("sum", "count")}
    wanted |= {f"prism:{name}_total": name for name in SERVER_COUNTERS}
    found = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        series, _, value = line.partition(" ")
        if series in wanted:
            found[wanted[series]] = float(value)
    missing = set(wanted.values()) - set(found)
    if missing:
        raise RuntimeError(f"the server's /metrics lacks {sorted(missing)}")
    return found


def server_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """Over the measured run: the server's mean of each histogram (ms), its prefix-cache hit rate (tokens), the
    media items its vision encoder ran and its preemptions."""
    delta = {key: after[key] - before[key] for key in after}
    figures = {f"server_mean_{short}_ms": (delta[f"{name}_sum"] / delta[f"{name}_count"] * 1e3
                                           if delta[f"{name}_count"] else None)
               for short, name in SERVER_HISTOGRAMS.items()}
    queries = delta["prefix_cache_queries"]
    figures["server_prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / queries if queries else None
    figures["server_vision_encoder_items"] = delta["vision_encoder_items"]
    figures["server_preemptions"] = delta["num_preemptions"]
    return figures


def _client_process(url: str, load: Load, groups: list[list[str]], k: int, barrier, done, results) -> None:
    """Client process `k` of `load.clients`: requests i with i % clients == k. Puts (start, end, records as dicts),
    or the failure's text."""
    try:
        results.put(asyncio.run(_client_requests(url, load, groups, k, barrier, done)))
    except Exception as error:  # the parent raises it: a failed request must fail the run, not shrink it
        barrier.abort()
        results.put(f"client {k}: {type(error).__name__}: {error}")


async def _client_requests(url: str, load: Load, groups: list[list[str]], k: int, barrier, done) -> tuple:
    from openai import AsyncOpenAI

    in_flight = max(1, load.concurrency // load.clients)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=in_flight)))

    async def one(i: int, group: int, kind: str) -> RequestRecord:
        text = f"{kind} {i}: what do pictures {group} have in common, and which one stands out?"
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages(groups[group], group, text, send=False), max_tokens=load.output_tokens,
            stream=True, stream_options={"include_usage": True}, logprobs=True, extra_body={"ignore_eos": True})
        record, last = RequestRecord(ttft=0.0, e2e=0.0), None
        async for chunk in stream:
            now = time.perf_counter()
            # logprobs: every token yields a chunk even when its text is empty (a random model's tokens often are)
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].logprobs):
                if last is None:
                    record.ttft = now - start
                else:
                    record.itls.append(now - last)
                last = now
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
                record.prompt_tokens = chunk.usage.prompt_tokens
        record.e2e = time.perf_counter() - start
        if last is None or record.output_tokens != load.output_tokens:
            raise RuntimeError(f"request {i}: {record.output_tokens} tokens of {load.output_tokens}, "
                               f"{'no' if last is None else 'some'} token streamed")
        return record

    gate = asyncio.Semaphore(in_flight)

    async def limited(i: int, group: int, kind: str = "Question") -> RequestRecord:
        async with gate:
            record = await one(i, group, kind)
        if kind == "Question":
            with done.get_lock():
                done.value += 1
        return record

    # Not measured: a server's first steps at each batch size pay one-time costs (kernel variants launched the
    # first time, allocator growth): the first run on a fresh H200 read FP8 40.4 req/s, the next 49.0.
    asked = [(i, g) for i, g in enumerate(zipf_groups(load)) if i % load.clients == k]
    warm = [(i, g) for i, g in enumerate(zipf_groups(load)[:load.warm_requests]) if i % load.clients == k]
    await asyncio.gather(*(limited(i, g, "Warm-up") for i, g in warm))
    await asyncio.to_thread(barrier.wait, 600)
    start = time.monotonic()
    records = await asyncio.gather(*(limited(i, g) for i, g in asked))
    end = time.monotonic()
    await client.close()
    return start, end, [dataclasses.asdict(r) for r in records]


def table(results: dict[str, dict], load: Load, gpu: str, date: str) -> str:
    names = list(results)
    rows = [
        ("Successful requests", "completed", "{:.0f}"), ("Benchmark duration (s)", "duration_s", "{:.2f}"),
        ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("Output token throughput (tok/s)", "output_token_throughput", "{:.1f}"),
        ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}"),
    ] + [(f"{kind} {label} (ms)", f"{kind.lower()}_{metric}_ms", "{:.2f}")
         for metric, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
         for kind in ("Mean", "Median", "P99")] + [
        ("Server's mean TTFT (ms, its /metrics)", "server_mean_ttft_ms", "{:.2f}"),
        ("- of which preparation (arrival to the engine)", "server_mean_preparation_ms", "{:.2f}"),
        ("- of which the engine's queue", "server_mean_queue_ms", "{:.2f}"),
        ("- of which prefill (scheduled to first token)", "server_mean_prefill_ms", "{:.2f}"),
        ("Server's mean ITL (ms, its /metrics)", "server_mean_itl_ms", "{:.2f}"),
        ("Prefix-cache hit rate (prompt tokens)", "server_prefix_cache_hit_rate", "{:.3f}"),
        ("Media items through the vision encoder", "server_vision_encoder_items", "{:.0f}"),
        ("Preemptions", "server_preemptions", "{:.0f}"),
    ]
    lines = [f"Serving (`prism serve` in its own process, {load.concurrency} concurrent `openai` clients streaming from "
             f"{load.clients} processes), "
             f"{gpu}, {date}: {load.num_prompts} chat requests over {load.groups} groups of {load.images_per_group} "
             f"{load.image_size}x{load.image_size} images (Zipf {load.zipf_s}, named by uuid after one send each), "
             f"{load.output_tokens} output tokens each", "",
             "| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, fmt in rows:
        cells = [fmt.format(results[n][key]) if results[n][key] is not None else "-" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    smoke = "--smoke" in sys.argv
    load = SMOKE if smoke else Load()
    if smoke:
        model, config = None, ROOT / "configs" / "cpu_tiny.json"
    else:
        model, config = CKPT, CONFIG
        if not (CKPT / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "bench" / "make_checkpoint.py")], check=True)
    groups = group_images(load)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = Path(tmp) / "bf16.json"
        bf16.write_text(json.dumps({**json.loads(config.read_text()), "kv_dtype": "bf16"}))
        kinds = [kind for kind in ("fp8", "bf16") if f"--{kind}-only" in sys.argv] or ["fp8", "bf16"]
        for name, cfg in ((f"{kind.upper()} KV", config if kind == "fp8" else bf16) for kind in kinds):
            with ServerProcess(model, cfg, Path(tmp) / "server.log") as server:
                results[name] = run_load(server.url, load, groups, progress=not smoke)
            print(f"{name}: {json.dumps(results[name])}", flush=True)  # a run cut short still reports it
    if smoke:
        gpu = "cpu-smoke"
    else:
        import torch

        gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    md = table(results, load, gpu, date)
    print(md)
    if not smoke:
        # a run of one kind is named for it: it must not replace the day's run of both
        name = "serve" if len(results) == 2 else "serve-" + next(iter(results)).split()[0].lower()
        write_results({"gpu": gpu, "date": date, "load": load.__dict__, **results}, md, gpu, date, name)


if __name__ == "__main__":
    main()
