"""Spec of async scheduling (the next decode step launched on tokens the host has not read), on the real engine
(tiny checkpoint, fp32, scaled-FP8 KV, CPU, the CUDA graphs' rows run eagerly on their buffers).

A stateful machine adds requests (greedy, seeded sampling that stops on a tenth of the vocabulary, logprobs; some
sharing an image, so later ones hit earlier ones' pages), steps, and aborts, over a small pool (continuations
that do not fit fall back to scheduled steps) and fewer graph rows than sequences, after a fixed tour of its rules
(`tour`: what the planted bugs need, reached whatever examples Hypothesis draws; its requests' tokens come from the
tiny checkpoint, so it checks once it ends that it reached them). Checked after every rule:
- a live sequence's KV content is its prompt and the tokens the host has read: the pending token a launched step
  reserved (`kv.manager.PENDING_TOKEN`; publishing one raises) is filled before `step` returns;
- the KV manager's accounting is exact (`check_invariants` on every step);
- each request's events are one stream: nothing after its terminal event, tokens that are its outputs.
At the end: exactly one terminal event per request, finish reasons that match the tokens, nothing leaked.
Each example starts on an engine holding nothing of another (`engine`): its verdict is its own.

And with every request added up front (no more than run at once), the tokens and finish reasons must be
those of the engine with async scheduling off, the logprobs within rounding: a continuation fed the wrong
row's token, or a stopped request's logits row taken for another's, changes them; the continuation must run.
"""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prism.engine.llm import LLM
from prism.engine.request import FinishReason
from prism.engine.sampling import SamplingParams
from prism.kv.manager import PENDING_TOKEN
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.hf_reference import random_images
from prism.testing.shared_engines import reused_while_clean
from specs.tours import Chosen

IMAGE = random_images([(64, 64)], seed=31)[0]
_IDS = itertools.count()
TEXTS = ("Hi.", "Tell me a story about a cat.", "What is two plus two?", "Name three colours, please.")


def chat(text: int, with_image: bool) -> list[dict]:
    content = [{"type": "image", "image": IMAGE}] if with_image else []
    return [{"role": "user", "content": [*content, {"type": "text", "text": TEXTS[text]}]}]


@reused_while_clean
def engine(async_scheduling: bool, chunks: bool = False, admissions: bool = False) -> LLM:
    """`chunks`: the packed graphs too, prompts interleaved 8 tokens at a time beside the decodes and a step
    budget smaller than a few prompts, so a later prompt's chunks go beside the decode rows (a continuation
    carries the next chunk of the one request still in its prompt). `admissions`: the packed graphs, and the
    scheduler runs while a step is in flight when requests wait (`async_admissions`).

    Each is built once and shared by the examples while it holds nothing of the last one: the examples name their
    requests r0, r1, ... again, so an engine a failed example left requests in would refuse their ids as in use."""
    if admissions:
        return LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=16, num_gpu_pages=24, max_num_seqs=4,
                   max_num_batched_tokens=256, graph_rows_without_cuda=True, cuda_graph_max_batch=4,
                   cuda_graph_max_packed_tokens=256, async_scheduling=async_scheduling,
                   async_admissions=async_scheduling, check_invariants=True)
    if chunks:
        return LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=16, num_gpu_pages=24, max_num_seqs=5,
                   max_num_batched_tokens=96, interleave_prefill_tokens=8, graph_rows_without_cuda=True,
                   cuda_graph_max_batch=4, cuda_graph_max_packed_tokens=128, async_scheduling=async_scheduling,
                   check_invariants=True)
    return LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=16, num_gpu_pages=11, max_num_seqs=5,
               max_num_batched_tokens=256, graph_rows_without_cuda=True, cuda_graph_max_batch=4,
               cuda_graph_max_packed_tokens=0, async_scheduling=async_scheduling, check_invariants=True)


def params_of(kind: str, max_tokens: int, seed: int, vocab: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams.greedy(max_tokens=max_tokens)
    if kind == "stops":
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                              stop_token_ids=tuple(range(seed % 10, vocab, 10)))
    return SamplingParams(temperature=0.7, seed=seed, max_tokens=max_tokens, logprobs=2)


def sampling_params_of(kind: str, max_tokens: int, seed: int, vocab: int) -> SamplingParams:
    """`params_of`, plus "greedy" and "seeded" kinds that never stop early (the token-equality specs)."""
    if kind == "greedy":
        return SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True)
    if kind == "seeded":
        return SamplingParams(temperature=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    return params_of(kind, max_tokens, seed, vocab)


class AsyncSchedulingMachine(RuleBasedStateMachine):
    chunks = False
    admissions = False

    @initialize()
    def setup(self) -> None:
        self.llm = engine(True, self.chunks, self.admissions)
        self.engine = self.llm.engine
        self.engine.kv.clear_cache()
        self.vocab = self.engine.runner.model.config.text.vocab_size
        self.params: dict[str, SamplingParams] = {}
        self.tokens: dict[str, list[int]] = {}
        self.terminal: dict[str, list] = {}
        self.count = 0

    def _take(self, events) -> None:
        for event in events:
            rid = event.request_id
            assert rid in self.params, f"an event for unknown request {rid}"
            assert not self.terminal.get(rid), f"{rid}: an event after its terminal event"
            self.tokens[rid] += event.new_token_ids
            if event.finished:
                self.terminal[rid] = [event]

    @rule(text=st.integers(0, len(TEXTS) - 1), with_image=st.booleans(), max_tokens=st.integers(1, 30),
          kind=st.sampled_from(["greedy", "stops", "logprobs"]), seed=st.integers(0, 99))
    def add(self, text: int, with_image: bool, max_tokens: int, kind: str, seed: int) -> None:
        rid = f"r{self.count}"
        self.count += 1
        params = params_of(kind, max_tokens, seed, self.vocab)
        self.engine.add_request(rid, self.engine.inputs.prepare_chat(chat(text, with_image)), params)
        self.params[rid], self.tokens[rid], self.terminal[rid] = params, [], []

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            self._take(self.engine.step())
            self.content_is_what_the_host_read()

    @precondition(lambda self: any(not t for t in getattr(self, "terminal", {}).values()))
    @rule(data=st.data())
    def abort(self, data) -> None:
        live = sorted(rid for rid, t in self.terminal.items() if not t)
        self.engine.abort(data.draw(st.sampled_from(live)))

    @invariant()
    def content_is_what_the_host_read(self) -> None:
        if not hasattr(self, "engine"):
            return
        for rid, seq in self.engine.kv.seqs.items():
            request = self.engine.requests[rid]
            tokens = seq.content.tokens
            read = list(request.prompt.kv_content().tokens) + request.output_token_ids
            assert PENDING_TOKEN not in tokens, f"{rid}: a pending token outlived its step"
            assert tokens == read, f"{rid}: KV content {tokens[-4:]} is not what the host read {read[-4:]}"

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(500):
            if not self.engine.has_unfinished_requests():
                break
            self._take(self.engine.step())
        assert not self.engine.has_unfinished_requests(), "requests still unfinished after 500 steps"
        for rid, params in self.params.items():
            assert len(self.terminal[rid]) == 1, f"{rid}: {len(self.terminal[rid])} terminal events"
            event, tokens = self.terminal[rid][0], self.tokens[rid]
            assert len(tokens) <= params.max_tokens, f"{rid}: {len(tokens)} tokens > max_tokens"
            if event.finish_reason is FinishReason.LENGTH:
                assert len(tokens) == params.max_tokens, f"{rid}: length stop after {len(tokens)} tokens"
            if event.finish_reason is FinishReason.STOP and params.stop_token_ids and tokens:
                stop = tokens[-1] in params.stop_token_ids or tokens[-1] in self.engine.inputs.eos_token_ids
                assert stop, f"{rid}: stopped on {tokens[-1]}"
            if event.finish_reason is not FinishReason.ABORT:
                assert all(t not in params.stop_token_ids for t in tokens[:-1]), f"{rid}: ran past a stop token"
        kv = self.engine.kv
        assert not kv.seqs, f"sequences left in the KV manager: {list(kv.seqs)}"
        kv.check_invariants()
        held = {p for p in range(kv.gpu.num_pages) if kv.gpu.refcount[p]}
        assert held <= set(kv.entries.entry_refs), "pages held by nothing but a finished request"


class AsyncChunksMachine(AsyncSchedulingMachine):
    """The same, where continuations also carry prefill chunks (`engine(..., chunks=True)`)."""

    chunks = True


class AsyncAdmissionsMachine(AsyncSchedulingMachine):
    """The same, where the scheduler admits waiting requests while a step is in flight (`admissions=True`)."""

    admissions = True


def tour(machine_class: type[AsyncSchedulingMachine] = AsyncSchedulingMachine) -> None:
    """The machine's rules in one fixed order through the requests' lives: two decoding with their next steps launched
    ahead (one with an image, one that stops with its next step in flight), three more added while they decode (one
    hitting the image's pages), an abort of a decoding request, and the teardown's drain and end checks; the invariant
    after each rule. Which of these the machine's derandomized examples reach changes with Hypothesis's version; the
    tour reaches each on every run (the planted checks run it first)."""
    m = machine_class()
    m.setup()

    def then(rule, *args) -> None:
        rule(*args)
        m.content_is_what_the_host_read()

    try:
        then(m.add, 0, False, 30, "greedy", 0)  # r0
        then(m.add, 1, True, 20, "stops", 3)  # r1: stops after 5 tokens
        then(m.step, 3)
        then(m.add, 2, True, 12, "logprobs", 5)  # r2: r1's image
        then(m.add, 3, False, 6, "greedy", 0)
        then(m.add, 0, False, 6, "logprobs", 7)  # r4
        then(m.step, 4)
        then(m.abort, Chosen("r0"))
        then(m.step, 4)
    except BaseException:
        with contextlib.suppress(Exception):  # drains the shared engine as far as it can; the failure is reported
            m.teardown()
        raise
    m.teardown()
    _reached_its_landmarks(m)


def _reached_its_landmarks(m: AsyncSchedulingMachine) -> None:
    """The states the tour is for, checked once it ends: its requests' tokens come from the tiny checkpoint's weights
    and seeded sampling, so a change of either could take the tour past them (r1 never stopping, r0 ending before
    its abort, every request ending at its first token so no launched-ahead step is ever filled); it then fails
    here, saying which, instead of passing without them."""
    def ended(rid: str):
        return m.terminal[rid][0]

    r1 = m.tokens["r1"]
    landmarks = {
        "r0 aborted while it decoded": ended("r0").finish_reason is FinishReason.ABORT and len(m.tokens["r0"]) >= 2,
        "r1 stopped on a stop token with its next step in flight": (
            ended("r1").finish_reason is FinishReason.STOP and len(r1) >= 2
            and r1[-1] in m.params["r1"].stop_token_ids),
        "r2 hit r1's pages": ended("r2").cached_tokens > 0,
        "r2 decoded past its first token (launched-ahead steps filled)": len(m.tokens["r2"]) >= 2,
    }
    missed = [what for what, reached in landmarks.items() if not reached]
    assert not missed, (f"the tour no longer reaches: {'; '.join(missed)} (tokens {m.tokens}): the tiny checkpoint's "
                        "tokens changed; choose its requests' seeds and lengths anew")


def spec_async_scheduling_commits_what_the_host_read() -> None:
    tour(AsyncSchedulingMachine)
    run_state_machine_as_test(AsyncSchedulingMachine, settings=settings(max_examples=25, stateful_step_count=20,
                                                                        deadline=None))


def spec_async_chunks_commit_what_the_host_read() -> None:
    tour(AsyncChunksMachine)
    run_state_machine_as_test(AsyncChunksMachine, settings=settings(max_examples=15, stateful_step_count=20,
                                                                    deadline=None))


def spec_async_admissions_commit_what_the_host_read() -> None:
    tour(AsyncAdmissionsMachine)
    run_state_machine_as_test(AsyncAdmissionsMachine, settings=settings(max_examples=20, stateful_step_count=25,
                                                                        deadline=None))


@settings(max_examples=12, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, len(TEXTS) - 1), st.booleans(), st.integers(1, 14),
                                   st.sampled_from(["greedy", "seeded", "stops", "logprobs"]), st.integers(0, 99)),
                         min_size=1, max_size=5),
       chunks=st.booleans())
def spec_async_scheduling_gives_the_tokens_of_scheduled_steps(requests, chunks: bool) -> None:
    """All requests added up front, no more than run at once (a waiting one would be admitted a step later beside
    other rows, and fp32 GEMMs over other batches round differently); some stop on a tenth of the vocabulary, so
    a launched step carries rows of requests that just stopped (dropped, the others' logits rows picked out). The
    tokens and finish reasons must be the engine's with async scheduling off, the logprobs within 1e-4: a dropped
    row's step has one row more than its counterpart, and an fp32 GEMM over another row count rounds differently
    in the last digits (measured: 5e-7). `chunks`: prompts that do not fit the first step go on in chunks beside
    the decodes, and the continuation launches the last one's chunks; a chunk at a stale position, or its
    rows fed the decode rows' tokens, changes the tokens."""
    prompts = [chat(text, image) for text, image, *_ in requests]
    vocab = engine(False, chunks).engine.runner.model.config.text.vocab_size
    params = [sampling_params_of(kind, n, seed, vocab) for _, _, n, kind, seed in requests]
    overlapped = engine(True, chunks)
    before = overlapped.engine.stats.async_steps
    got = outcomes(overlapped, prompts, params)
    want = outcomes(engine(False, chunks), prompts, params)
    tokens = [(t, reason) for t, reason, _ in got]
    assert tokens == [(t, reason) for t, reason, _ in want], \
        f"async scheduling changed the tokens:\n{got}\nvs scheduled steps\n{want}"
    for (_, _, ours), (_, _, theirs) in zip(got, want, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs] and all(
            abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ours, theirs, strict=True)), \
            f"async scheduling changed the logprobs: {ours} vs {theirs}"
    if not chunks and len(requests) <= 4 and max(n for _, _, n, _, _ in requests) > 2:  # the graphs take 4 rows
        assert overlapped.engine.stats.async_steps > before, "no step was launched ahead"


def outcomes(llm: LLM, prompts, params) -> list[tuple]:
    llm.engine.kv.clear_cache()
    return [(c.token_ids, c.finish_reason, [(lp.token_id, lp.logprob) for lp in c.logprobs or []])
            for c in llm.generate(prompts, params)]


@settings(max_examples=12, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, len(TEXTS) - 1), st.booleans(), st.integers(1, 10),
                                   st.sampled_from(["greedy", "seeded", "stops", "logprobs"]), st.integers(0, 99),
                                   st.integers(0, 6)),
                         min_size=2, max_size=7))
def spec_async_admissions_give_the_tokens_of_scheduled_steps(requests) -> None:
    """Requests arriving while others decode (more than run at once, so some wait for a seat): with the scheduler
    running while a step is in flight, each request's tokens and finish reason are those of the engine that
    schedules every step after reading the last one's tokens, the logprobs within 1e-2: a request may be admitted
    a step later than there (a row whose token in flight ends it keeps its seat until that token is read), so
    beside other rows, and fp32 GEMMs over other batches round differently, which the FP8 KV can turn into a
    rounding step (measured: 1e-4). A decode row
    fed another row's token, a pending slot the scheduler preempts or publishes, or an admitted prompt's rows
    fed the device's tokens change them."""
    vocab = engine(False, admissions=True).engine.runner.model.config.text.vocab_size
    params = [sampling_params_of(kind, n, seed, vocab) for _, _, n, kind, seed, _ in requests]
    got = staggered(engine(True, admissions=True), requests, params)
    want = staggered(engine(False, admissions=True), requests, params)
    for rid in want:
        assert got[rid][:2] == want[rid][:2], f"{rid}: async admissions changed the tokens: {got[rid]} vs {want[rid]}"
        assert all(t == u and abs(a - b) < 1e-2 for (t, a), (u, b) in zip(got[rid][2], want[rid][2], strict=True)), \
            f"{rid}: async admissions changed the logprobs: {got[rid][2]} vs {want[rid][2]}"


def staggered(llm: LLM, requests, params) -> dict[str, tuple]:
    """Request i added after the engine's `arrival_i`-th step call from the previous arrival; each request's
    (tokens, finish reason, logprobs)."""
    eng = llm.engine
    eng.kv.clear_cache()
    out: dict[str, list] = {}
    done: dict[str, tuple] = {}
    ids = []
    for (text, image, *_, arrival), p in zip(requests, params, strict=True):
        for _ in range(arrival):
            take(eng.step(), out, done)
        rid = f"s{next(_IDS)}"
        ids.append(rid)
        eng.add_request(rid, eng.inputs.prepare_chat(chat(text, image)), p)
        out[rid] = [[], []]
    while eng.has_unfinished_requests():
        take(eng.step(), out, done)
    return {f"r{k}": done[rid] for k, rid in enumerate(ids)}


def take(events, out: dict, done: dict) -> None:
    for event in events:
        tokens, logprobs = out[event.request_id]
        tokens += event.new_token_ids
        logprobs += [(lp.token_id, lp.logprob) for lp in event.logprobs or []]
        if event.finished:
            done[event.request_id] = (tuple(tokens), event.finish_reason, logprobs)
