"""Spec of *nothing is lost* over HTTP (`serving/app.py`, `serving/async_engine.py`, `serving/metrics.py`,
`engine/lost_steps.py` `fail_a_lost_step`): one real server in a thread (the tiny checkpoint), driven by a stateful
machine whose rules are what clients do (`server_clients.py`): chat and text completions, decides, a client that
leaves a stream after its first event, one that gives up before its answer, a decide whose client leaves before its
answer, bodies the server refuses, images named by uuid (sent with it, by a refused request, named alone: known or
not; the machine tracks the names the server knows), two of these at once, and a request under which a model step
fails (planted), alone or beside another.

The machine's random examples, and its tour (`tour`): every kind of action once, the simplest of each, so that no
run misses one whatever examples Hypothesis draws (CI's once did every action but a streamed chat without an image).

Invariant, once the server is idle after each rule:
- every client got a well-formed answer: a 200 of the right shape (each choice with a finish reason; a stream of
  `data:` events ending in `data: [DONE]`, each choice's last chunk the one with its finish reason), or a 4xx with an
  OpenAI error body; a request a step failed under, a 500 naming only a request id (streamed: that error event last
  before [DONE]), and beside another, as many such answers as the lost step held requests; a known image name is
  served and hits the prefix cache, an unknown one is a 400 asking for the image that makes no engine request;
- nothing is held for a request: no handler running, nothing in the async engine (streams, admission slots), and
  the engine holds nothing (`prism.testing.shared_engines.holdings`: no request running, waiting or swapped, no
  question not forked, no unread event, no detokenizer, no step in flight, no penalty count slot, no KV sequence or
  planned move, no swap page, every KV page in use only the prefix cache's, evictable); the KV refcounts are exact;
- the Prometheus counters grew by exactly what the clients' actions made: a choice by its finish reason, a client that
  left by "abort" (as vLLM counts it), a failed request by "error", a decide answered with its questions, one whose
  client left by "abandoned" (its questions each ended by abort), a refusal by its status.
Found by it (session 30): a step lost before the runner took its transfer plan left the plan's pages pinned, on an
idle server for good (`reproducers/lost_step_left_its_plan_pinned.py`). Planted below, each must make the machine
fail: that, a close that does not abort, a stream ended by an error without [DONE], an abort that leaks its pages, a
client that left uncounted, a non-streaming client's work left running, a uuid bound by a refused request, an
abandoned decide uncounted, one whose questions run on, a lost step failing only one of its requests.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import torch
from hypothesis import Phase, find, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from prometheus_client.parser import text_string_to_metric_families

from prism.engine import lost_steps
from prism.engine.engine import Engine
from prism.engine.inputs import InputProcessor
from prism.engine.request import FinishReason
from prism.serving import app as app_module
from prism.serving.async_engine import AsyncEngine, GenerationEvents
from prism.serving.completions import CompletionRenderer
from prism.serving.metrics import ServingMetrics
from prism.serving.responses import error_body, sse
from prism.serving.settings import ServerSettings
from prism.serving.stream import ChatCompletionStream
from prism.testing.serving import failing_at, open_request, replaced, serve_in_thread
from prism.testing.shared_engines import holdings
from specs.server_clients import (
    DECIDE,
    IMAGES,
    Ask,
    any_client,
    chats,
    completions,
    decides,
    disconnects,
    leavers,
    named_image,
    perform,
    refusals,
    together,
)

IDLE_S = 5.0  # what a server may take to be idle after a rule (its clients already have their answers)
# Which model step of a lone request fails: every one goes through `runner.execute`, except decodes replaying graph
# rows (CUDA), which take their own path.
FAILING_STEPS = st.just(1) if torch.cuda.is_available() else st.integers(1, 3)
# The counters checked: family -> the label that splits it (`server_clients.Series`).
COUNTED = {"prism:request_success": "finished_reason", "prism:decide_requests": "outcome",
           "prism:decide_questions": None, "prism:requests_rejected": "status"}


@functools.lru_cache(maxsize=1)
def served():
    return serve_in_thread(ServerSettings())  # a daemon thread: it ends with the process


# -- what the server holds --------------------------------------------------------------------------------------------
def held_for_requests(server) -> dict[str, int]:
    """What the server holds for requests, counted (nothing, once idle): its handlers and async engine's, and its
    engine's (`shared_engines.holdings`)."""
    async_engine = server.app.state.prism.async_engine
    return {
        "request handlers running": len(server.server.server_state.tasks),
        "streams of the async engine": async_engine.num_in_flight,
        "admission slots taken": async_engine._slots_taken,
        **holdings(server.engine),
    }


def held_beyond(server, before: dict[str, int], seconds: float) -> dict[str, int]:
    """What the server holds beyond `before`, after waiting up to `seconds` for it to be nothing."""
    deadline = time.time() + seconds
    while True:
        beyond = {what: n - before[what] for what, n in held_for_requests(server).items() if n > before[what]}
        if not beyond or time.time() > deadline:
            return beyond
        time.sleep(0.02)


def counted(url: str) -> Counter:
    """The checked counters now, by `Series`."""
    out: Counter = Counter()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name in COUNTED:
            label = COUNTED[family.name]
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[family.name.removeprefix("prism:"), sample.labels[label] if label else ""] += int(sample.value)
    return out


def _one_choice(ask: Ask, what: str, stream: bool) -> Ask:
    """`ask` as one choice of one prompt, `stream`ed or not, running 8 tokens (no stop)."""
    body = {key: value for key, value in ask.body.items() if key not in ("stop", "stream_options")}
    body |= {"n": 1, "stream": stream, "max_tokens": 8, "ignore_eos": True}
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][0]
    return Ask(what, ask.path, body)


# -- a decide whose client leaves ------------------------------------------------------------------------------------
def leave_a_decide(server, ask: Ask, before: dict[str, int]) -> Counter:
    """`ask` (a decide) sent on a connection closed once its questions are in the engine, which runs no step until
    the handler has seen its client go (and returned): the questions can only end by abort. Asserts that each did, once
    the server holds no more than `before`; returns the counters it must move."""
    engine, ended, handler_done = server.engine, [], threading.Event()
    in_engine = threading.Event()
    step = engine.step

    def step_once_the_client_left():
        if not handler_done.is_set():
            in_engine.set()
            time.sleep(0.01)
            if len(server.server.server_state.tasks) <= before["request handlers running"]:
                handler_done.set()
            return []  # no step: after the handler, the engine's loop takes its aborts before the next one
        events = step()
        ended.extend(event for event in events if event.finished)
        return events

    body = json.dumps(ask.body).encode()
    with replaced(engine, "step", step_once_the_client_left):
        with open_request(server.url, DECIDE, len(body)) as client:
            client.sendall(body)
            assert in_engine.wait(30), f"{ask.what}: its questions never reached the engine"
        held = held_beyond(server, before, IDLE_S)
    assert not held, f"{ask.what}: {IDLE_S} s after its client left, the server still holds {held}"
    reasons = {event.request_id.rpartition("/")[2]: event.finish_reason for event in ended}
    questions = {f"q{i}" for i in range(ask.choices)}
    assert questions <= set(reasons) and set(reasons.values()) == {FinishReason.ABORT}, (
        f"{ask.what}: its engine requests ended {reasons}, not each by abort (questions {sorted(questions)})")
    return Counter({("decide_requests", "abandoned"): 1})


# -- the machine ------------------------------------------------------------------------------------------------------
# The failures the machine raised, as they were raised: a planted check reads them here, since Hypothesis's replay
# of a failing example against a real server may draw differently from the first run (timing) and report only that
# (FlakyStrategyDefinition), losing the failure the first run found.
RAISED: list[str] = []


def recorded(function):
    """A rule or invariant of the machine whose AssertionErrors are kept in RAISED before they propagate."""
    @functools.wraps(function)
    def recording(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except AssertionError as failure:
            RAISED.append(str(failure))
            raise
    return recording


DRAWN: set[str] = set()  # the kinds of action done, over a run: the tour must do each
EVERY_ACTION = {"chat", "chat streamed", "chat with an image", "chat streamed with an image", "completion",
                "completion streamed", "decide", "disconnect", "leave", "refused", "two at once", "a failed step",
                "a failed step streamed", "a failed step beside another", "a named image sent", "a named image refused", "a known name",
                "an unknown name", "a decide abandoned"}
EXAMPLES = itertools.count()  # the server outlives an example: each names its images afresh


class NothingLost(RuleBasedStateMachine):
    serve = staticmethod(served)  # the planted checks serve a server of their own

    @initialize()
    def settle(self) -> None:
        """The counters and what the server holds, once idle: the example is checked against them. (After a failed
        example, whose failure is reported, its engine requests are aborted, and what it leaked for good is where the
        next one starts: Hypothesis then replays a failing example as it ran, rather than failing it at the start.)"""
        self.server = self.serve()
        nothing = dict.fromkeys(held_for_requests(self.server), 0)
        if held_beyond(self.server, nothing, 0.5).get("engine requests"):
            for request_id in list(self.server.engine.requests):
                self.server.app.state.prism.async_engine.abort(request_id)
        held_beyond(self.server, nothing, IDLE_S)
        self.held, self.before, self.expected = held_for_requests(self.server), counted(self.server.url), Counter()
        self.names = [f"example-{next(EXAMPLES)}-image-{i}" for i in range(len(IMAGES))]  # IMAGES[i]'s
        self.known: set[str] = set()  # the names the server knows: a request sending them was accepted
        self.refused_names: list[str] = []  # names only refused requests sent

    def _do(self, *asks: Ask) -> None:
        DRAWN.update(ask.what for ask in asks)
        self.expected += perform(self.server.url, asks[0]) if len(asks) == 1 else together(self.server.url, list(asks))

    @rule(ask=chats())
    @recorded
    def chat(self, ask: Ask) -> None:
        self._do(ask)

    @rule(ask=completions())
    @recorded
    def text_completion(self, ask: Ask) -> None:
        self._do(ask)

    @rule(ask=decides(), abandoned=st.booleans())
    @recorded
    def decide(self, ask: Ask, abandoned: bool) -> None:
        """A decide answered, or one whose client leaves before its answer."""
        if abandoned:
            ask = replace(ask, what="a decide abandoned")
            DRAWN.add(ask.what)
            self.expected += leave_a_decide(self.server, ask, self.held)
        else:
            self._do(ask)

    @rule(ask=disconnects)
    @recorded
    def disconnect_mid_stream(self, ask: Ask) -> None:
        self._do(ask)

    @rule(ask=leavers)
    @recorded
    def leave_before_the_answer(self, ask: Ask) -> None:
        self._do(ask)

    @rule(ask=refusals)
    @recorded
    def refused(self, ask: Ask) -> None:
        self._do(ask)

    @rule(how=st.sampled_from(["a named image sent", "a named image refused", "a known name", "an unknown name"]),
          image=st.sampled_from(range(len(IMAGES))), data=st.data())
    @recorded
    def an_image_named_by_uuid(self, how: str, image: int, data) -> None:
        """A chat sending an image with its uuid (the name is the server's once the request is accepted: a refused
        one, here for its max_tokens, names nothing), or naming one by its uuid alone: a known one is served and its
        prompt hits the prefix cache; an unknown one (never sent, or sent by a refused request) is a 400 that asks
        for the image, and no engine request."""
        if how == "a known name" and not self.known:
            self._send_a_named_image(image, self.names[image], data)
        if how == "a named image sent":
            self._send_a_named_image(image, self.names[image], data)
        elif how == "a named image refused":  # under a name of its own, then named alone: it names nothing
            self.refused_names.append(f"{self.names[image]}-refused-{len(self.refused_names)}")
            self._send_a_named_image(image, self.refused_names[-1], data, refused=True)
            self._name_an_unknown_image(self.refused_names[-1], data)
        elif how == "a known name":
            ask = data.draw(chats(image_part=named_image(data.draw(st.sampled_from(sorted(self.known))), None)))
            if ask.streamed:  # its usage shows the hit
                ask = replace(ask, body=ask.body | {"stream_options": {"include_usage": True}})
            self._do(replace(ask, what=how, hits=True))
        else:
            unknown = sorted(set(self.names) - self.known) + self.refused_names + [self.names[image] + "-never-sent"]
            self._name_an_unknown_image(data.draw(st.sampled_from(unknown)), data)

    def _send_a_named_image(self, image: int, name: str, data, refused: bool = False) -> None:
        ask = data.draw(chats(image_part=named_image(name, image)))
        if refused:
            ask = replace(ask, status=400, body=ask.body | {"max_tokens": 40_000})
        self._do(replace(ask, what="a named image refused" if refused else "a named image sent"))
        if not refused:
            self.known.add(name)

    def _name_an_unknown_image(self, name: str, data) -> None:
        ask = data.draw(chats(image_part=named_image(name, None)))
        finished = self.server.engine.stats.requests_finished
        self._do(replace(ask, what="an unknown name", status=400, message="send the image"))
        assert self.server.engine.stats.requests_finished == finished, f"{ask.what}: it made an engine request"

    @rule(first=any_client, second=any_client)
    @recorded
    def two_at_once(self, first: Ask, second: Ask) -> None:
        DRAWN.add("two at once")
        self._do(first, second)

    @rule(ask=st.one_of(chats(), completions()), stream=st.booleans(), at_call=FAILING_STEPS,
          beside=st.one_of(st.none(), st.tuples(st.one_of(chats(), completions()), st.booleans())))
    @recorded
    def a_step_fails_under_a_request(self, ask: Ask, stream: bool, at_call: int,
                                     beside: tuple[Ask, bool] | None) -> None:
        """The engine idle, its `at_call`-th model step from now raises at the runner's entry: one of this request's
        (one choice of one prompt, more tokens than `at_call`). Or `beside` another such request at once: the step
        is either's or both's, and it loses only its own (each client in it gets the internal error, the other its
        answer)."""
        failing = _one_choice(ask, "a failed step" + " streamed" * stream, stream)
        if beside is None:
            with failing_at(self.server.engine.runner, "execute", RuntimeError("planted: a lost step"), at_call):
                self._do(replace(failing, fails=True))
            return
        pair = [replace(failing, may_fail=True),
                replace(_one_choice(beside[0], "a failed step beside another", beside[1]), may_fail=True)]
        engine, lost = self.server.engine, []
        fail_a_lost_step = lost_steps.fail_a_lost_step

        def failing_its_requests(on, plan, requests, error, *args) -> None:
            lost.extend(request.request_id for request in requests)  # (its slices', and one whose media it encoded)
            fail_a_lost_step(on, plan, requests, error, *args)

        before = self.expected[("request_success", "error")]
        with (replaced(lost_steps, "fail_a_lost_step", failing_its_requests),  # looked up there by every step
              failing_at(engine.runner, "execute", RuntimeError("planted: a lost step"), at_call)):
            self._do(*pair)
        in_the_step = set(lost)
        failed = self.expected[("request_success", "error")] - before
        assert failed == len(in_the_step), f"a step lost {sorted(in_the_step)}, but {failed} of its clients failed"

    @invariant()
    @recorded
    def nothing_is_lost(self) -> None:
        held = held_beyond(self.server, self.held, IDLE_S)
        assert not held, f"{IDLE_S} s after its clients were done, the server still holds {held}"
        if not any(self.held.values()):  # (refcounts an earlier, failed example broke stay broken)
            self.server.engine.kv.check_invariants()
        moved = counted(self.server.url)
        moved.subtract(self.before)
        moved = +moved  # counters only grow: what is left is what moved
        assert moved == self.expected, f"counters moved by {dict(moved)}; the clients' actions make {dict(self.expected)}"


STEPS = settings(max_examples=25, stateful_step_count=10, deadline=None)


def spec_nothing_is_lost_whatever_clients_do() -> None:
    run_state_machine_as_test(NothingLost, settings=STEPS)


class Simplest:
    """What a rule's `data` draws in the tour: each strategy's simplest value (`hypothesis.find`, always the same)."""

    @staticmethod
    def draw(strategy):
        return find(strategy, lambda value: True)


def _with_an_image(ask_strategy):
    return ask_strategy(image_part={"type": "image_url", "image_url": {"url": IMAGES[0]}})


def tour(machine: NothingLost) -> None:
    """Every client action once, in a fixed order, each the simplest of its kind, the invariant checked after each.
    The random examples may miss a rare action (which ones they draw changes with Hypothesis's version); the tour
    never does, so every action, and the planted bug only one of them shows, is checked on every run."""
    simplest = Simplest.draw
    chat, completion, decide = simplest(chats(stream=False)), simplest(completions(stream=False)), simplest(decides())
    actions = [
        lambda: machine.chat(chat),
        lambda: machine.chat(simplest(chats(stream=True))),
        lambda: machine.chat(simplest(_with_an_image(functools.partial(chats, stream=False)))),
        lambda: machine.chat(simplest(_with_an_image(functools.partial(chats, stream=True)))),
        lambda: machine.text_completion(completion),
        lambda: machine.text_completion(simplest(completions(stream=True))),
        lambda: machine.decide(decide, abandoned=False),
        lambda: machine.decide(decide, abandoned=True),
        lambda: machine.disconnect_mid_stream(simplest(disconnects)),
        lambda: machine.leave_before_the_answer(simplest(leavers)),
        lambda: machine.refused(simplest(refusals)),
        *(functools.partial(machine.an_image_named_by_uuid, how, 0, Simplest) for how in
          ("a named image sent", "a known name", "a named image refused", "an unknown name")),
        lambda: machine.two_at_once(chat, completion),
        lambda: machine.a_step_fails_under_a_request(chat, False, 1, None),
        lambda: machine.a_step_fails_under_a_request(chat, True, 1, None),
        lambda: machine.a_step_fails_under_a_request(chat, False, 1, (completion, False)),
    ]
    for action in actions:
        action()
        machine.nothing_is_lost()


def spec_each_client_action_loses_nothing() -> None:
    """The machine's tour (`tour`) on the shared server: every kind of action it draws, done once."""
    DRAWN.clear()
    machine = NothingLost()
    machine.settle()
    tour(machine)
    assert DRAWN == EVERY_ACTION, f"the tour did {sorted(DRAWN)}, not every action {sorted(EVERY_ACTION)}"


# -- planted bugs: each must make the machine fail ---------------------------------------------------------------------
@contextmanager
def own_server():
    """A server of the planted check's own: the bug may leave it holding what it lost."""
    server = serve_in_thread(ServerSettings())
    try:
        yield server
    finally:
        server.app.state.prism.async_engine.begin_shutdown()  # what a bug left running ends (uvicorn waits for it)
        server.stop()


def _machine_fails(match: str, attempts: int = 3) -> None:
    """The machine on a server of its own, generating only (not shrinking), fails with an AssertionError that
    `match`es: as Hypothesis reports it, or as the machine raised it (`RAISED`: Hypothesis may report a FlakyFailure
    or a FlakyStrategyDefinition instead, its replay having run on the server the bug had changed). Up to `attempts`
    runs, each on a fresh server: the examples are fixed, the timing is not (on a loaded machine the two requests of a
    pair may not share a step, or a slow release may trip another check first), so the bug must show in one of them."""
    outcomes = []
    for _ in range(attempts):
        outcome = _machine_run(match)
        if outcome is None:
            return
        outcomes.append(outcome)
    raise AssertionError(f"in {attempts} runs the machine never failed with {match!r}: {outcomes}")


def _machine_run(match: str) -> str | None:
    """One planted run: None when the machine failed with `match`, else what it did instead."""
    RAISED.clear()
    with own_server() as server:
        machine = type("PlantedNothingLost", (NothingLost,), {"serve": staticmethod(lambda: server)})
        planted = settings(STEPS, phases=[Phase.generate], report_multiple_bugs=False, database=None,
                           derandomize=True)
        try:
            touring = machine()
            touring.settle()
            tour(touring)
            run_state_machine_as_test(machine, settings=planted)
        except BaseException as failure:  # noqa: BLE001 - looked into below
            failures = _flattened(failure)
            found = [str(f) for f in failures if isinstance(f, AssertionError)] + RAISED
            if any(re.search(match, message) for message in found):
                return None
            return f"failed otherwise: {failures}; raised on the way: {RAISED}"
        return "passed"


def _flattened(failure: BaseException) -> list[BaseException]:
    if isinstance(failure, BaseExceptionGroup):
        return [f for inner in failure.exceptions for f in _flattened(inner)]
    return [failure]


def test_a_close_that_does_not_abort_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's events closed unread (its client left mid-stream) without aborting it: it runs for nobody."""

    async def close_without_abort(self) -> None:
        if not self._done:
            self._done = True
            self._abandoned()

    monkeypatch.setattr(GenerationEvents, "aclose", close_without_abort)
    monkeypatch.setattr(GenerationEvents, "__del__", lambda self: None)
    _machine_fails("still holds .*engine requests")


def test_a_stream_ended_by_an_error_without_done_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose request failed ends with the error event but no [DONE] (clients wait for it)."""

    def error_without_done(status: int, message: str) -> bytes:
        return sse(error_body(status, message))

    monkeypatch.setattr(ChatCompletionStream, "error", staticmethod(error_without_done))
    monkeypatch.setattr(CompletionRenderer, "error", staticmethod(error_without_done))
    _machine_fails(r"does not end with \[DONE\]")


def test_an_abort_that_leaks_its_pages_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted request's KV sequence dropped without giving back its pages."""
    finish = Engine._finish

    def finish_leaking_on_abort(self, request, reason, *args, **kwargs) -> None:
        if reason is FinishReason.ABORT:
            self.kv.seqs.pop(request.request_id, None)
        finish(self, request, reason, *args, **kwargs)

    monkeypatch.setattr(Engine, "_finish", finish_leaking_on_abort)
    _machine_fails("KV pages held not only by the prefix cache")


def test_a_client_that_left_uncounted_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 27's review: a request aborted because its client left was in no finished-request series."""
    monkeypatch.setattr(GenerationEvents, "_abandoned", lambda self: None)
    _machine_fails("counters moved by")


def test_a_non_streaming_client_left_running_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 22's review: a non-streaming completion whose client left ran to its end."""

    async def until_done(request, work):
        return await work

    monkeypatch.setattr(app_module, "until_disconnected", until_done)  # looked up by the endpoints
    _machine_fails("still holds .*engine requests")


def test_a_lost_step_that_leaves_its_plan_pinned_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by this spec (reproducers/lost_step_left_its_plan_pinned.py): a step lost before the runner took its
    transfer plan failed its requests and left the plan's pages pinned, on an idle server for good. Planted where a
    lost step's plan is settled now (the engine takes every step's plan): it is neither run nor unpinned."""
    monkeypatch.setattr(lost_steps, "settle_the_plan", lambda engine, plan: None)  # looked up by fail_a_lost_step
    _machine_fails("KV pages held not only by the prefix cache")


def test_a_uuid_bound_by_a_refused_request_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 27's review (reproducers/refused_request_binds_its_uuid.py): a chat's image uuids were bound as its
    prompt was prepared, so a request refused afterwards named its image anyway."""
    prepare_chat = InputProcessor.prepare_chat
    monkeypatch.setattr(InputProcessor, "prepare_chat",
                        lambda self, messages, **kwargs: prepare_chat(self, messages, **kwargs | {"bind_names": True}))
    _machine_fails("an unknown name .*: 200")


def test_an_abandoned_decide_uncounted_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decide whose client left in no outcome of `prism:decide_requests`."""
    init = ServingMetrics.__init__

    def init_not_counting_the_abandoned(self, engine) -> None:
        init(self, engine)
        decides, nothing = self.decides, SimpleNamespace(inc=lambda: None)
        self.decides = SimpleNamespace(labels=lambda outcome: nothing if outcome == "abandoned"
                                       else decides.labels(outcome=outcome))

    monkeypatch.setattr(ServingMetrics, "__init__", init_not_counting_the_abandoned)
    _machine_fails("counters moved by")


def test_an_abandoned_decide_left_to_run_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decide whose client left, its questions not aborted: they run on for nobody (to their answers here)."""

    async def decide_not_aborting(self, decision_id, branches):
        stream = await self._submit(tuple(b.request_id for b in branches),
                                    lambda engine: engine.add_decision(decision_id, branches))
        finals = {}
        while len(finals) < len(branches):
            event = await stream.queue.get()
            finals |= {event.request_id: event} if event.finished else {}
        return finals

    monkeypatch.setattr(AsyncEngine, "decide", decide_not_aborting)
    _machine_fails("not each by abort")


def test_a_lost_step_failing_one_of_its_requests_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost step that fails only the first of its requests: the others go on from a step never computed (the
    pair's other client gets an answer rather than the internal error)."""
    fail_a_lost_step = lost_steps.fail_a_lost_step
    monkeypatch.setattr(lost_steps, "fail_a_lost_step", lambda engine, plan, requests, error, *args: fail_a_lost_step(
        engine, plan, requests[:1], error, *args))
    _machine_fails("of its clients failed")
