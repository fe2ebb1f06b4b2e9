"""`bench/bench_serve.py` reports `vllm bench serve`'s figures: TPOT without the first token (none for a one-token
request), ITLs pooled over requests, numpy's linear percentiles, throughputs over the run's duration."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_serve import Load, RequestRecord, serve_metrics, server_figures, zipf_groups  # noqa: E402


def test_figures_of_two_requests_by_hand():
    records = [RequestRecord(ttft=0.1, e2e=0.5, itls=[0.05, 0.15, 0.1, 0.1], output_tokens=5, prompt_tokens=10),
               RequestRecord(ttft=0.2, e2e=0.2, itls=[], output_tokens=1, prompt_tokens=20)]
    m = serve_metrics(records, duration_s=2.0)
    assert m["completed"] == 2 and m["request_throughput"] == 1.0
    assert m["output_token_throughput"] == 3.0 and m["total_token_throughput"] == 18.0
    assert m["mean_ttft_ms"] == pytest.approx(150) and m["median_ttft_ms"] == pytest.approx(150)
    assert m["p99_ttft_ms"] == pytest.approx(199)  # 100 + 0.99 * (200 - 100): linear, as numpy and vLLM
    # TPOT: only the 5-token request, (500 - 100) ms over its 4 tokens after the first
    assert m["mean_tpot_ms"] == m["median_tpot_ms"] == m["p99_tpot_ms"] == pytest.approx(100)
    assert m["mean_itl_ms"] == pytest.approx(100) and m["median_itl_ms"] == pytest.approx(100)
    assert m["p99_itl_ms"] == pytest.approx(148.5)  # sorted 50, 100, 100, 150: 100 + 0.97 * 50
    assert m["mean_e2el_ms"] == pytest.approx(350)


def test_one_token_requests_have_no_tpot_and_an_empty_run_is_refused():
    m = serve_metrics([RequestRecord(ttft=0.1, e2e=0.1, output_tokens=1)], duration_s=1.0)
    assert m["mean_tpot_ms"] is None and m["p99_itl_ms"] is None
    with pytest.raises(ValueError, match="no completed requests"):
        serve_metrics([], duration_s=1.0)


def test_the_groups_follow_zipf_and_are_the_same_for_each_config():
    load = Load(num_prompts=2000, groups=8, seed=3)
    groups = zipf_groups(load)
    assert groups == zipf_groups(load), "each config must get the same requests"
    counts = [groups.count(g) for g in range(8)]
    assert counts[0] > counts[1] > counts[7] > 0, counts


def test_the_servers_figures_are_over_the_measured_run_only():
    """Deltas of /metrics between before and after the run: histogram means of the run's observations, the hit rate
    of the run's lookups."""
    names = ("time_to_first_token", "inter_token_latency", "request_preparation_time", "request_queue_time",
             "request_prefill_time")
    before = {f"{n}_{p}": 1.0 for n in names for p in ("sum", "count")} | {
        "prefix_cache_queries": 100.0, "prefix_cache_hits": 0.0, "vision_encoder_items": 8.0, "num_preemptions": 1.0}
    after = {f"{n}_{p}": 1.0 + (0.5 if p == "sum" else 10) for n in names for p in ("sum", "count")} | {
        "prefix_cache_queries": 1100.0, "prefix_cache_hits": 900.0, "vision_encoder_items": 8.0, "num_preemptions": 1.0}
    after["request_queue_time_count"] = 1.0  # nothing observed in the run
    f = server_figures(before, after)
    assert f["server_mean_ttft_ms"] == pytest.approx(50) and f["server_mean_prefill_ms"] == pytest.approx(50)
    assert f["server_mean_queue_ms"] is None
    assert f["server_prefix_cache_hit_rate"] == pytest.approx(0.9)
    assert f["server_vision_encoder_items"] == 0 and f["server_preemptions"] == 0
