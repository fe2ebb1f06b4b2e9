"""The TP2 engine (issue 8) on the CPU: two ranks over gloo (the engine spawns rank 1) against the TP1 engine.

Greedy tokens equal TP1 (and logprobs agree to fp32 noise) on a text prompt, a 3-image prompt batched with
it, a cached request (the same images, another question: a prefix hit that sends no pixels to rank 1), a
decision (fork + copy-on-write of the material's tail page on both ranks) and a pool too small for its
requests with swap preemption (swap-out/in on both ranks). A follower that dies makes rank 0 fail with a
clear error instead of hanging. Capacity and encoder-DP units: tests/test_tp_ranks.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from prism.decision.questions import Question
from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.engine.step_payload import StepPayload
from prism.engine.tp_workers import TensorParallelFailure
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images
from prism.testing.tp_faults import (
    LOST_STEP,
    live_followers,
    lose_device_token_steps,
    lose_steps_after_their_payload,
)

IMAGES = random_images([(64, 96), (96, 64), (64, 64)], seed=3)
GREEDY = SamplingParams.greedy(max_tokens=6, ignore_eos=True, logprobs=2)
COMMON = dict(kv_dtype="fp8", page_size=4, max_num_batched_tokens=160, check_invariants=True, distributed_timeout_s=60)
LOGPROB_ATOL = 1e-4


def chat(*parts) -> list[dict]:
    content = [{"type": "image", "image": p} if not isinstance(p, str) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def _scenario(tp: int) -> dict:
    """Everything the TP1/TP2 comparison looks at, from one engine of each size."""
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=tp, num_gpu_pages=96, **COMMON)
    payloads: list[StepPayload] = []
    if llm.engine.runner.publish is not None:
        send = llm.engine.runner.publish

        def record(payload):
            payloads.append(payload)
            send(payload)

        llm.engine.runner.publish = record
    try:
        out: dict = {"pages": llm.engine.runner.layout.num_pages, "kv_heads": llm.engine.runner.layout.num_kv_heads}
        first = llm.generate(["Tell me a story about paged attention.",
                              chat(IMAGES[0], IMAGES[1], IMAGES[2], "Compare these pictures.")], GREEDY)
        encoded = llm.engine.runner.stats.vision_items_encoded
        sent_before = len(payloads)
        (cached,) = llm.generate([chat(IMAGES[0], IMAGES[1], IMAGES[2], "Which one is the brightest?")], GREEDY)
        out["cached_payloads"] = payloads[sent_before:]
        out["encoded"] = (encoded, llm.engine.runner.stats.vision_items_encoded)
        out["completions"] = first + [cached]
        out["answers"] = llm.decide(chat(IMAGES[0], "Look at the picture."),
                                    [Question("yes_no", "Is it bright?"), Question("yes_no", "Is it a cat?")])
        return out
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def runs():
    return {tp: _scenario(tp) for tp in (1, 2)}


def _assert_same(tp1, tp2):
    for a, b in zip(tp1, tp2, strict=True):
        assert a.token_ids == b.token_ids, f"{a.request_id}: TP2 {b.token_ids} != TP1 {a.token_ids}"
        assert a.cached_tokens == b.cached_tokens
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) <= LOGPROB_ATOL
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]


def test_tp2_greedy_equals_tp1_text_images_and_cached(runs):
    _assert_same(runs[1]["completions"], runs[2]["completions"])
    cached = runs[2]["completions"][-1]
    assert cached.cached_tokens > 0, "the second question over the same images must be a prefix hit"


def test_tp2_splits_kv_heads_and_keeps_the_page_count(runs):
    assert runs[2]["kv_heads"] * 2 == runs[1]["kv_heads"]
    assert runs[2]["pages"] == runs[1]["pages"] == 96


def test_full_prefix_hit_sends_no_pixels_and_runs_no_vision(runs):
    before, after = runs[2]["encoded"]
    assert before == 3 and after == before
    payloads = runs[2]["cached_payloads"]
    assert payloads, "rank 0 must have broadcast the cached request's steps"
    assert all(not m.encode and m.pixels is None for p in payloads for m in p.media), "a full hit must send no pixels"


def test_tp2_decision_fork_equals_tp1(runs):
    for a, b in zip(runs[1]["answers"], runs[2]["answers"], strict=True):
        assert a.answer == b.answer
        assert a.probabilities == pytest.approx(b.probabilities, abs=1e-5)


def test_tp2_swap_preemption_equals_tp1():
    """A pool too small for four growing requests: swap-out and swap-in run on both ranks."""
    torch.set_num_threads(1)
    prompts = [f"Request {i}: please count slowly from one to twenty." for i in range(4)]
    params = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=tp, num_gpu_pages=16, num_cpu_pages=64,
                  preemption="swap", max_num_seqs=4, **COMMON)
        try:
            results[tp] = ([c.token_ids for c in llm.generate(prompts, params)], llm.engine.stats.preemptions)
        finally:
            llm.engine.shutdown()
    assert results[1][1] > 0, "the scenario must preempt"
    assert results[2] == results[1]


KILLED = r"rank 1 exited with code -9 \(SIGKILL\)"


def _killed(process) -> float:
    """SIGKILL a follower, not reaped here (the engine must notice by itself); when."""
    os.kill(process.pid, signal.SIGKILL)
    return time.perf_counter()


def test_a_follower_killed_while_the_engine_is_idle_is_noticed_before_the_next_step():
    """A follower killed after a successful start, while no step runs: the engine says at once that it is stopped
    (what /health reads), a new request is refused naming the follower's exit, and the step of a request accepted
    before the death fails before its payload goes out (under NCCL, inside the step's first collective, rank 0 would
    wait out `distributed_timeout_s`, 300 s here), stopping every rank; the request then ends."""
    from prism.engine.engine import EngineStopped

    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=32,
              **dict(COMMON, distributed_timeout_s=300))
    engine = llm.engine
    try:
        engine.add_request("before", "Hello there", SamplingParams.greedy(max_tokens=2))
        killed = _killed(engine._followers.processes[0])
        while not engine.is_stopped:
            assert time.perf_counter() - killed < 10, "the engine did not notice its follower's death"
            time.sleep(0.05)
        with pytest.raises(EngineStopped, match=KILLED):
            engine.add_request("after", "Hello again", SamplingParams.greedy(max_tokens=2))
        with pytest.raises(TensorParallelFailure, match=rf"before this step went out.*{KILLED}"):
            engine.step()
        assert time.perf_counter() - killed < 30, "rank 0 waited for the step's collectives to time out"
        assert engine._followers.closed and live_followers() == []
        engine.abort("before")  # what the server's engine thread and `LLM` do after a failed step
        (event,) = engine.step()
        assert event.request_id == "before" and event.finished
    finally:
        engine.shutdown()


def test_a_follower_killed_under_a_live_server_fails_its_stream_health_and_the_next_request(tmp_path):
    """Over HTTP: a follower killed while a stream runs ends that stream with an error (its terminal event), `/health`
    answers 503 and the next request a 503 naming the follower's exit, well within `distributed_timeout_s`; the
    server's stop leaves no follower behind."""
    import json

    import httpx

    from prism.serving.settings import ServerSettings
    from prism.testing.serving import serve_in_thread

    torch.set_num_threads(1)
    config = tmp_path / "tp2.json"
    config.write_text(json.dumps(dict(COMMON, tensor_parallel_size=2, device="cpu", num_gpu_pages=32,
                                      distributed_timeout_s=300)))
    server = serve_in_thread(ServerSettings(engine_config_path=config))
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        body = {"model": "prism-tiny", "messages": [{"role": "user", "content": "Talk."}], "ignore_eos": True,
                "stream": True}  # up to max_model_len: it runs when the follower is killed
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            killed = _killed(server.engine._followers.processes[0])
            rest = [line for line in lines if line]
        assert time.perf_counter() - killed < 30, "the stream waited for the step's collectives to time out"
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "restart" in health.text
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "prism-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert refused.status_code == 503, refused.text
    finally:
        server.stop()
    assert live_followers() == []


def test_each_rank_gets_only_the_pixels_it_encodes():
    """A cold step's payload, as each rank of two receives it: every item to encode has its pixels on exactly
    one rank (the encoder-DP owner), cached items have none anywhere, and nothing else changes."""
    import torch as _torch

    from prism.engine.step_payload import MediaWork, StepPayload
    from prism.kv.transfers import TransferPlan

    px = {g: _torch.zeros(g[0] * g[1] * g[2], 4) for g in ((1, 8, 8), (1, 4, 4), (1, 6, 6))}
    media = [MediaWork(bytes([i]), g, True, t) for i, (g, t) in enumerate(px.items())]
    media.append(MediaWork(b"cached", (1, 4, 4), False, None))
    payload = StepPayload(TransferPlan(), [], media)
    views = [payload.for_rank(r, 2) for r in range(2)]
    for i, m in enumerate(media[:3]):
        holders = [r for r, v in enumerate(views) if v.media[i].pixels is not None]
        assert len(holders) == 1, f"item {i} must travel to exactly one rank, went to {holders}"
        assert all(v.media[i].encode and v.media[i].grid == m.grid for v in views)
    assert all(v.media[3].pixels is None and not v.media[3].encode for v in views)
    assert {r for r, v in enumerate(views) for m in v.media if m.pixels is not None} == {0, 1}
    assert payload.for_rank(0, 1) is payload


ASYNC = dict(graph_rows_without_cuda=True, tensor_parallel_async_scheduling=True)


def _async_run(tp: int, plant=None, **overrides) -> tuple[list, dict]:
    """Steps launched on tokens no host has read (async scheduling, continuations and steps scheduled ahead: two
    seats for four prompts keep requests waiting; the last prompt hits the second's pages), the graphs' rows run
    eagerly on the CPU. `plant(runner)`: a bug planted in rank 0's runner before the requests; `overrides`: engine
    settings."""
    torch.set_num_threads(1)
    prompts = ["Tell me a story about paged attention.", chat(IMAGES[0], IMAGES[1], "Compare these pictures."),
               "Request two: please count slowly from one to twenty.",
               chat(IMAGES[0], IMAGES[1], "Which one is brighter?")]  # a prefix hit: its tail page copied
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=tp, num_gpu_pages=96, max_num_seqs=2,
              **{**ASYNC, **COMMON, **overrides})
    plans_beside_device_rows = []
    run = llm.engine.runner.run

    def probed(payload, token_ids=None):  # a probe, not a bug: a transfer plan in a step with device-token rows
        plans_beside_device_rows.append(bool(payload.device_token_rows) and not payload.plan.is_empty())
        return run(payload, token_ids)

    llm.engine.runner.run = probed
    try:
        if plant is not None:
            plant(llm.engine.runner)
        # Lengths that end apart: a seat frees while another request decodes, so the scheduler runs ahead of an
        # admission beside rows fed device tokens.
        out = llm.generate(prompts, [SamplingParams.greedy(max_tokens=n, ignore_eos=True, logprobs=2)
                                     for n in (4, 14, 10, 8)])
        stats, ran = llm.engine.stats, llm.engine.runner.stats
        return out, {"async": stats.async_steps, "ahead": stats.scheduled_ahead_steps,
                     "eager": ran.steps - ran.graph_steps - ran.packed_graph_steps,
                     "plans_beside_device_rows": sum(plans_beside_device_rows)}
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def async_runs():
    return {tp: _async_run(tp) for tp in (1, 2)}


def test_tp2_async_scheduling_equals_tp1(async_runs):
    """`tensor_parallel_async_scheduling`: the followers take each such step's tokens from rank 0 (a broadcast in
    `ModelRunner.run`), and TP2's greedy tokens and logprobs equal TP1's, which schedules the same way."""
    (tp1, counts1), (tp2, counts2) = async_runs[1], async_runs[2]
    # both kinds of step ran under TP, one of them copying the hit's tail page beside a row fed device tokens
    assert counts2["async"] > 0 and counts2["ahead"] > 0 and counts2["plans_beside_device_rows"] > 0, counts2
    assert counts2 == counts1
    _assert_same(tp1, tp2)


def test_tp2_async_scheduling_equals_tp1_in_eager_steps():
    """Without the packed graphs and with row graphs of at most 8 rows, the steps scheduled ahead (an admission's
    prefill beside a row fed device tokens) run eagerly: the followers' rows get rank 0's tokens there too."""
    eager_on_device_tokens = []

    def count(runner):  # rank 0's eager forwards fed device tokens (not a bug: a probe)
        forward = runner._forward

        def counted(fwd, features, token_ids=None):
            eager_on_device_tokens.append(token_ids is not None)
            return forward(fwd, features, token_ids)

        runner._forward = counted

    eager = dict(cuda_graph_max_packed_tokens=0, cuda_graph_max_batch=8)
    tp1, counts1 = _async_run(1, **eager)
    tp2, counts2 = _async_run(2, count, **eager)
    assert counts2["ahead"] > 0 and any(eager_on_device_tokens), (counts2, eager_on_device_tokens)
    assert counts2 == counts1
    _assert_same(tp1, tp2)


def test_tp2_async_scheduling_is_off_by_default():
    """Without the setting a TP engine launches no step on unread tokens (its followers would have none)."""
    config = dict(COMMON, graph_rows_without_cuda=True)
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=32, **config)
    try:
        llm.generate(["Hello there", "Hi again"], SamplingParams.greedy(max_tokens=4, ignore_eos=True))
        assert llm.engine.stats.async_steps == 0
    finally:
        llm.engine.shutdown()


def test_tp2_followers_fed_placeholder_tokens_are_caught(async_runs):
    """Planted: the payload does not say which rows take rank 0's device tokens, so rank 0 feeds its own and the
    followers the payload's placeholder ids. TP2's tokens then part from TP1's (the vocab-parallel embedding of a
    token in rank 1's half goes missing)."""
    import dataclasses

    def plant(runner):
        prepare = runner.prepare

        def without_device_rows(*a, **k):
            return dataclasses.replace(prepare(*a, **k), device_token_rows=0)

        runner.prepare = without_device_rows

    planted, _ = _async_run(2, plant)
    with pytest.raises(AssertionError):
        _assert_same(async_runs[1][0], planted)


def test_a_step_on_device_tokens_lost_after_its_payload_went_out_stops_every_rank():
    """Rank 0 fails a step launched on unread tokens after the followers received it (they are inside its
    collectives): every rank stops with `TensorParallelFailure` at once, as a scheduled step's failure does, instead
    of rank 0 failing the step's requests and going on to collectives the followers never reach."""
    torch.set_num_threads(1)
    # (a follower left inside a collective leaves when that collective times out)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=32, **ASYNC,
              **dict(COMMON, distributed_timeout_s=10))
    lose_device_token_steps(llm.engine.runner)
    try:
        with pytest.raises(TensorParallelFailure, match=LOST_STEP):
            llm.generate(["Hello there", "Hi again"], SamplingParams.greedy(max_tokens=6, ignore_eos=True))
        assert llm.engine._followers.closed
    finally:
        llm.engine.shutdown()


def test_a_rank_0_failure_inside_a_step_stops_every_rank_without_waiting_out_the_timeout():
    """Review (session 28): after a step's payload went out, rank 0's failure told the followers to stop with a
    message none could take (each was inside the lost step's collectives): rank 0 raised only when
    `distributed_timeout_s` (300 s by default) ran out. The followers are now terminated. After it, and after a
    shutdown, a new request is refused with a clear error."""
    from prism.engine.engine import EngineStopped

    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=32,
              **dict(COMMON, distributed_timeout_s=300))  # the default
    lose_steps_after_their_payload(llm.engine.runner)
    started = time.perf_counter()
    try:
        with pytest.raises(TensorParallelFailure, match=LOST_STEP):
            llm.generate(["Hello there"], SamplingParams.greedy(max_tokens=4, ignore_eos=True))
        assert time.perf_counter() - started < 60, "rank 0 waited for the followers' collectives to time out"
        assert all(not p.is_alive() for p in llm.engine._followers.processes)
        assert llm.engine.is_stopped
        with pytest.raises(EngineStopped, match="build a new engine"):
            llm.generate(["Again"], SamplingParams.greedy(max_tokens=2))
        assert not llm.engine.requests
    finally:
        llm.engine.shutdown()
