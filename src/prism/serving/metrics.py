"""Prometheus metrics, named as vLLM names them (prefix `prism:`), on a registry per app.

Latency histograms are observed from each request's event stream (on the event loop); cache and
pool figures are read from the engine's own counters at scrape time, so they cost nothing per step.
Prefix-cache queries and hits count tokens; media-cache queries and hits count images.
A request's TTFT is split at its first token into the server's preparation (arrival to the engine's taking it:
parsing, media, tokenizing, the hand-over to the engine thread), the engine's queue (taken to first scheduled: vLLM's
`request_queue_time_seconds`) and its prefill (first scheduled to its first token read: vLLM's
`request_prefill_time_seconds`), so a slow TTFT says which of the three it is.
Decides (`/v1/decide`) are not completions: they have no tokens to time, so they have series of their own (their
latency from arrival to the answer, and their outcomes), and their engine requests are not in the completion series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.engine import Engine
from ..engine.request import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineCollector:
    """Reads the engine's counters when Prometheus scrapes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        kv = e.kv
        yield _counter("prism:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.stats.queries_tokens)
        yield _counter("prism:prefix_cache_hits", "Prompt tokens served from the prefix cache.", kv.stats.hit_tokens)
        media = e.inputs.cache.stats() if e.inputs.cache is not None else None
        if media is not None:
            yield _counter("prism:mm_cache_queries", "Media items looked up in the preprocessing cache.",
                           media.hits + media.misses)
            yield _counter("prism:mm_cache_hits", "Media items served from the preprocessing cache.", media.hits)
        runner = e.runner.stats
        yield _counter("prism:vision_encoder_items", "Media items run through the vision encoder.", runner.vision_items_encoded)
        yield _counter("prism:encoder_cache_hits", "Media items whose vision features came from the encoder cache.",
                       runner.encoder_cache_hits)
        yield _counter("prism:num_preemptions", "Requests preempted (swapped out or recomputed).", e.stats.preemptions)
        yield _gauge("prism:kv_cache_pages_total", "KV pages in the GPU pool.", kv.gpu.num_pages)
        used, reclaimable = kv.gpu.num_used, kv.entries.num_reclaimable()
        yield _gauge("prism:kv_cache_pages_used", "KV pages referenced (requests, cache entries, transfers).", used)
        yield _gauge("prism:kv_cache_pages_reclaimable", "KV pages only prefix-cache entries hold (evictable now).",
                     reclaimable)
        # As vLLM counts it: pages only the cache holds are free to take, so a warm, idle server reads 0.
        yield _gauge("prism:kv_cache_usage_perc", "Fraction of KV pages held by requests or transfers.",
                     (used - reclaimable) / max(kv.gpu.num_pages, 1))
        yield _gauge("prism:num_requests_running", "Requests running (scheduled with pages).", len(e.scheduler.running))
        yield _gauge("prism:num_requests_waiting", "Requests waiting to be scheduled.", len(e.scheduler.waiting))
        yield _gauge("prism:num_requests_swapped", "Requests swapped out to the CPU pool.", len(e.scheduler.swapped))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


class ServingMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        r = self.registry
        self.ttft = Histogram("prism:time_to_first_token_seconds", "Time to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("prism:inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("prism:e2e_request_latency_seconds", "Time from arrival to the terminal event.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.preparation = Histogram("prism:request_preparation_time_seconds",
                                     "Time from a request's arrival to the engine's taking it (parsing, media, "
                                     "tokenizing, hand-over), of requests that produced a token.",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("prism:request_queue_time_seconds", "Time a request waited in the engine before it "
                               "was first scheduled, of requests that produced a token.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("prism:request_prefill_time_seconds", "Time from a request's first scheduling to "
                                 "its first token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("prism:request_success", "Finished requests by reason.", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("prism:prompt_tokens", "Prompt tokens of finished requests (a prompt once, however "
                                     "many choices).", registry=r)
        self.generation_tokens = Counter("prism:generation_tokens", "Generated tokens.", registry=r)
        self.decide_latency = Histogram("prism:decide_latency_seconds",
                                        "Time from a decide's arrival to its answer, of decides answered.",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.decides = Counter("prism:decide_requests", "Decides that reached the engine, by outcome (answered, "
                               "failed: the engine failed a question, abandoned: the client left).", ["outcome"],
                               registry=r)
        self.decide_questions = Counter("prism:decide_questions", "Questions of answered decides.", registry=r)
        self.rejected = Counter("prism:requests_rejected", "Requests refused before reaching the engine, by HTTP status.",
                                ["status"], registry=r)

    def decided(self, arrival: float, now: float, questions: int) -> None:
        self.decide_latency.observe(now - arrival)
        self.decides.labels(outcome="answered").inc()
        self.decide_questions.inc(questions)

    def tracker(self, arrival: float, count_prompt: bool = True) -> RequestTracker:
        return RequestTracker(self, arrival, count_prompt)


class RequestTracker:
    """Observes one request's events: TTFT at the first token, ITL between tokens, E2E at the end. `count_prompt`:
    whether its prompt tokens are counted (a completion's other choices of one prompt: no, as usage counts them)."""

    def __init__(self, metrics: ServingMetrics, arrival: float, count_prompt: bool = True) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.count_prompt = count_prompt
        self.last_token: float | None = None

    def __call__(self, event: RequestOutput, now: float) -> None:
        m = self.metrics
        if event.new_token_ids:
            if self.last_token is None:
                m.ttft.observe(now - self.arrival)
                self._observe_first_token_parts(event)
            else:
                m.itl.observe((now - self.last_token) / len(event.new_token_ids))
            self.last_token = now
            m.generation_tokens.inc(len(event.new_token_ids))
        if event.finished:
            m.e2e.observe(now - self.arrival)
            if self.count_prompt:
                m.prompt_tokens.inc(event.prompt_tokens)
            m.finished.labels(finished_reason=event.finish_reason.value if event.finish_reason else "unknown").inc()

    def _observe_first_token_parts(self, event: RequestOutput) -> None:
        """TTFT's parts (the engine's times, on the same perf_counter clock as `arrival`); the part after them is
        the event's way to the event loop."""
        times = event.times
        if times is None or times.first_scheduled is None or times.first_token is None:
            return
        m = self.metrics
        m.preparation.observe(times.arrival - self.arrival)
        m.queue.observe(times.first_scheduled - times.arrival)
        m.prefill.observe(times.first_token - times.first_scheduled)

    def abandoned(self, now: float) -> None:
        """The client left before the request's terminal event was read (its request is aborted): counted as vLLM
        counts it, a finished request with reason "abort", and its E2E up to now."""
        self.metrics.e2e.observe(now - self.arrival)
        self.metrics.finished.labels(finished_reason="abort").inc()
