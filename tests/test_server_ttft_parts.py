"""TTFT's parts in `/metrics` (the real server, uvicorn in a thread): each request that streams a token is counted
once in `prism:request_preparation_time_seconds` (arrival to the engine's taking it), `request_queue_time_seconds`
(taken to first scheduled) and `request_prefill_time_seconds` (first scheduled to the first token), and a delay
planted in one part lands in that part's histogram and in no other. The parts add up to no more than TTFT."""

from __future__ import annotations

import time

import httpx
import pytest

from prism.serving.settings import ServerSettings
from prism.testing.serving import replaced, serve_in_thread

PREPARATION_DELAY_S = 0.3
PREFILL_DELAY_S = 0.2
REQUESTS = 3
PARTS = ("request_preparation_time", "request_queue_time", "request_prefill_time", "time_to_first_token")


@pytest.fixture(scope="module")
def served():
    server = serve_in_thread(ServerSettings())
    yield server
    server.stop()


def _sums_and_counts(url: str) -> dict[str, tuple[float, float]]:
    found = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for part in PARTS:
            for field, i in (("sum", 0), ("count", 1)):
                if line.startswith(f"prism:{part}_seconds_{field} "):
                    found.setdefault(part, [0.0, 0.0])[i] = float(line.split()[1])
    assert set(found) == set(PARTS), f"/metrics lacks {set(PARTS) - set(found)}"
    return {part: (s, c) for part, (s, c) in found.items()}


def _slowed(call, seconds: float, only_prompt_steps: bool = False):
    def slow(*args, **kwargs):
        if not only_prompt_steps or any(s.request.times.first_token is None for s in args[0]):
            time.sleep(seconds)
        return call(*args, **kwargs)
    return slow


def test_a_delay_in_each_part_lands_in_its_own_histogram(served):
    engine = served.engine
    before = _sums_and_counts(served.url)
    # Preparation runs on the server's worker threads, the step on the engine thread: each delay is in one part only.
    with replaced(engine.inputs, "prepare_chat", _slowed(engine.inputs.prepare_chat, PREPARATION_DELAY_S)), \
            replaced(engine.runner, "execute", _slowed(engine.runner.execute, PREFILL_DELAY_S, only_prompt_steps=True)):
        for i in range(REQUESTS):  # one at a time: none waits for another
            response = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
                "model": "prism-tiny", "messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 2})
            assert response.status_code == 200, response.text
    after = _sums_and_counts(served.url)
    mean = {}
    for part in PARTS:
        total, count = (after[part][k] - before[part][k] for k in range(2))
        assert count == REQUESTS, f"{part}: {count} observations for {REQUESTS} requests"
        mean[part] = total / count
    assert mean["request_preparation_time"] >= PREPARATION_DELAY_S, mean
    assert mean["request_prefill_time"] >= PREFILL_DELAY_S, mean
    # The other part's delay is not in it: each part stays below the delay planted in the other one.
    assert mean["request_preparation_time"] < PREPARATION_DELAY_S + PREFILL_DELAY_S, mean
    assert mean["request_prefill_time"] < PREFILL_DELAY_S + PREPARATION_DELAY_S, mean
    assert 0 <= mean["request_queue_time"] < PREFILL_DELAY_S, mean
    parts = sum(mean[p] for p in PARTS[:3])
    assert parts <= mean["time_to_first_token"], mean


def test_the_check_fails_when_the_first_tokens_event_carries_no_times(served, monkeypatch):
    """Planted: the times copied only onto the terminal event (the first token's event has none), so the parts are
    never observed at the first token."""
    from prism.engine.request import RequestOutput

    real = RequestOutput.of.__func__

    def terminal_only(cls, request, new_tokens, text, logprobs):
        event = real(cls, request, new_tokens, text, logprobs)
        if not event.finished:
            event.times = None
        return event

    monkeypatch.setattr(RequestOutput, "of", classmethod(terminal_only))
    with pytest.raises(AssertionError, match="observations for"):
        test_a_delay_in_each_part_lands_in_its_own_histogram(served)
