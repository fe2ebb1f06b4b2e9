"""Spec of the penalties' count table (`prism.engine.penalty_counts`): a slot counts its request's history exactly
once, only a running request holds one, and so a table of `max_num_seqs` slots never runs out.

A state machine drives the real table (of as many slots as requests may run at a time) through real `Request`s:
requests arrive (each with a prompt, maybe some output already, and a mix of the repetition / frequency / presence
penalties, a logit_bias, or none), start running while a seat is free, get tokens appended (one or several between
two samples, as under async scheduling), are sampled through `adjusted_logits` in random subsets and orders of the
running ones (with rows without penalties, and a row whose history has no slot, counted for that step only), are
preempted (swapped out or dropped to recompute, a swapped one dropped to recompute later) and resumed, and end in any
order: finished for any reason (and still referenced, as an in-flight step references them) or dropped without
finishing. After every step:
- each request holding a slot is running, has that row equal to a recount of the output it counted, its prompt plane
  equal to its prompt's tokens once filled, and a row no other request holds; row 0 (what rows without penalties
  read) is 0;
- the table's slots in use are exactly those of the live requests holding one (preempted and ended requests hold
  none), so never more than the requests running;
- a sampled row's adjusted logits are bitwise those computed from its whole history from scratch (a resumed request
  too: its fresh slot is refilled from everything it output before it was preempted).

On the real engine (tiny checkpoint, CPU, fp32 KV), a pool too small for its requests, swap or recompute preemption,
async scheduling or not, and a shared-prefill deferral that lets a younger request run ahead of an older one (so
preempted requests wait beside requests that run): after every step the requests holding a slot run and are at most
`max_num_seqs`, and every greedy penalized request's tokens are those of an engine whose pool preempts nobody.
"""

from __future__ import annotations

import itertools
from collections import Counter
from types import SimpleNamespace

import hypothesis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from prism.engine.config import EngineConfig
from prism.engine.engine import Engine
from prism.engine.penalties import TokenHistory, adjusted_logits
from prism.engine.penalty_counts import PenaltyCounts
from prism.engine.request import FinishReason, Request, RequestState
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.shared_engines import reused_while_clean
from specs.spec_sampling_penalties import reference_adjusted

VOCAB = 11
SLOTS = 3  # requests running at a time (the engine's max_num_seqs)
KNOBS = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.5},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7, "presence_penalty": -1.0, "frequency_penalty": 2.0},
    {"frequency_penalty": -0.5, "logit_bias": {3: 2.5}},
    {"logit_bias": {1: -100.0}},  # adjusts its logits, but no penalty: no slot
    {},
]
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=6)


class PenaltyCountsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = PenaltyCounts("cpu", VOCAB, slots=SLOTS)
        self.live: dict[str, Request] = {}
        self.ended: list[Request] = []  # finished, still referenced (an in-flight step holds its requests)
        self.arrivals = 0

    def _running(self) -> list[str]:
        return sorted(rid for rid, r in self.live.items() if r.state is RequestState.RUNNING)

    def _pick(self, data, *states: RequestState) -> Request | None:
        rids = sorted(rid for rid, r in self.live.items() if r.state in states)
        return self.live[data.draw(st.sampled_from(rids))] if rids else None

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), output=tokens,
          knobs=st.sampled_from(KNOBS))
    def arrive(self, prompt, output, knobs) -> None:
        request = Request(f"r{self.arrivals}", SimpleNamespace(token_ids=prompt), SamplingParams(**knobs),
                          self.arrivals)
        request.output_token_ids.extend(output)  # a first sample may come after many tokens (a recomputed request)
        self.live[request.request_id] = request
        self.arrivals += 1
        if len(self._running()) < SLOTS:  # admitted at once while a seat is free
            request.transition(RequestState.RUNNING)

    @rule(data=st.data())
    def start_running(self, data) -> None:
        """A waiting request admitted, or a swapped one resumed, while a seat is free."""
        request = self._pick(data, RequestState.WAITING, RequestState.SWAPPED)
        if request is not None and len(self._running()) < SLOTS:
            request.transition(RequestState.RUNNING)

    @rule(data=st.data(), new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))
    def append(self, data, new) -> None:
        request = self._pick(data, RequestState.RUNNING)
        if request is not None:
            request.output_token_ids.extend(new)

    @rule(data=st.data(), seed=st.integers(0, 2**16), with_unslotted=st.booleans())
    def sample(self, data, seed, with_unslotted) -> None:
        running = self._running()
        rows = data.draw(st.permutations(running))[: data.draw(st.integers(0, len(running)))]
        unslotted = None
        if with_unslotted and len(running) < SLOTS:  # a history without a slot (the sampler's direct callers)
            unslotted = TokenHistory(data.draw(tokens), data.draw(tokens))
        self.sample_rows(rows, seed, unslotted)

    def sample_rows(self, rows: list[str], seed: int, unslotted: TokenHistory | None = None) -> None:
        """One sampling step over these running requests (and a row for `unslotted`, a history without a slot):
        each row adjusted as its whole history says."""
        requests = [self.live[r] for r in rows]
        params = [r.params for r in requests]
        histories = [r.token_history() if r.params.has_penalties else None for r in requests]
        if unslotted is not None:  # a row for this step only
            params.append(SamplingParams(presence_penalty=1.0, repetition_penalty=1.3))
            histories.append(unslotted)
        if not params:
            return
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
        got = adjusted_logits(logits, params, histories, self.table)
        for i, (p, h) in enumerate(zip(params, histories, strict=True)):
            want = reference_adjusted(logits[i], p, h or TokenHistory((), ()))
            assert torch.equal(got[i], want), (
                f"row {i} ({p}) was adjusted to {got[i].tolist()}; from its whole history {h}: {want.tolist()}")

    @rule(data=st.data(), to=st.sampled_from([RequestState.WAITING, RequestState.SWAPPED]))
    def preempt(self, data, to) -> None:
        """Preempted: swapped out, or dropped to recompute (every output token is kept either way)."""
        request = self._pick(data, RequestState.RUNNING)
        if request is not None:
            request.transition(to)

    @rule(data=st.data())
    def drop_swapped(self, data) -> None:
        """A swapped request dropped to recompute (`Scheduler._drop_swapped`)."""
        request = self._pick(data, RequestState.SWAPPED)
        if request is not None:
            request.transition(RequestState.WAITING)

    @rule(data=st.data(), reason=st.sampled_from(list(FinishReason)))
    def finish(self, data, reason) -> None:
        if self.live:
            request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
            request.finish(reason, "failed" if reason is FinishReason.ERROR else None)
            self.ended.append(request)

    @rule(data=st.data())
    def drop_unfinished(self, data) -> None:
        """A request dropped without finishing (an engine let go with requests in it): its slot goes back when it is
        collected."""
        if self.live:
            del self.live[data.draw(st.sampled_from(sorted(self.live)))]

    @invariant()
    def slots_are_their_running_requests_histories_and_none_leaks(self) -> None:
        table = self.table
        holders = {r.request_id: r._penalty_counts for r in self.live.values()
                   if r._penalty_counts is not None and r._penalty_counts.table is table}
        idle = sorted(rid for rid in holders if self.live[rid].state is not RequestState.RUNNING)
        assert not idle, f"{idle} hold a slot while not running: the slots are bounded by the requests running"
        assert table.in_use == len(holders), (
            f"{table.in_use} slots in use, {len(holders)} live requests holding one ({sorted(holders)}): a slot leaked")
        rows = [s.index for s in holders.values()]
        assert len(set(rows)) == len(rows) and 0 not in rows, f"slots shared or row 0 given out: {rows}"
        if table.counts is None:
            return
        assert not table.counts[0].any(), "row 0, read by rows without penalties, is not zero"
        for rid, slot in holders.items():
            output = self.live[rid].output_token_ids[: slot.counted]
            recount = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).int()
            assert torch.equal(table.counts[slot.index], recount), (
                f"{rid}'s slot counts {table.counts[slot.index].tolist()}; its {slot.counted} counted tokens "
                f"{dict(Counter(output))} recount as {recount.tolist()}")
            if slot.prompt_filled:
                prompt = set(self.live[rid].prompt.token_ids)
                assert table.prompt_seen[slot.index].nonzero().flatten().tolist() == sorted(prompt), (
                    f"{rid}'s prompt plane is not its prompt's tokens {sorted(prompt)}")


STEPS = settings(max_examples=100, stateful_step_count=40, deadline=None)


def tour() -> None:
    """The machine's rules in one fixed order that every slot's life takes: taken at a first sample, given back when
    preempted (to waiting and to swapped), taken again refilled from the whole history on resuming, a freed row given
    to another request, ended; the invariant checked after each. The planted checks run it before the machine: which
    of the machine's derandomized examples reach a preemption after a sample changed between CI's runs."""
    m = PenaltyCountsMachine()
    penalized = {"presence_penalty": 1.5, "frequency_penalty": 0.5}

    def then(action, *args) -> None:
        action(*args)
        m.slots_are_their_running_requests_histories_and_none_leaks()

    then(m.arrive, [1, 2], [3], penalized)
    then(m.arrive, [4], [5, 5], {"repetition_penalty": 1.3})
    then(m.sample_rows, ["r0", "r1"], 1)
    then(m.live["r0"].transition, RequestState.WAITING)
    then(m.live["r1"].transition, RequestState.SWAPPED)
    then(m.arrive, [6], [7], penalized)  # takes a row r0 or r1 gave back
    then(m.sample_rows, ["r2"], 2)
    then(m.live["r0"].transition, RequestState.RUNNING)
    then(m.live["r1"].transition, RequestState.RUNNING)
    then(m.live["r0"].output_token_ids.extend, [8, 3])
    then(m.live["r2"].output_token_ids.extend, [9])
    then(m.sample_rows, ["r0", "r1", "r2"], 3)
    for rid in ("r0", "r1", "r2"):
        request = m.live.pop(rid)
        then(request.finish, FinishReason.STOP, None)
        m.ended.append(request)


def spec_a_slot_counts_its_history_once_and_none_leaks() -> None:
    tour()
    run_state_machine_as_test(PenaltyCountsMachine, settings=STEPS)


# ---------------------------------------------------------------------------------------- on the engine

SHARED = ("The quick brown fox jumps over the lazy dog while the sea rolls on and on under a grey sky, far away, and "
          "the gulls cry out over the waves.\n")
TEXTS = (SHARED + "Go on.", SHARED + "And then?", "Hi.", "Name three colours, please.", SHARED + "Why?")
PENALTIES = ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.5},
             {"presence_penalty": 2.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3})
MAX_NUM_SEQS = 2


@reused_while_clean
def engine(pool_pages: int, preemption: str, async_scheduling: bool) -> Engine:
    """Two requests at a time over 96-token sequences; 24 pages of 4 tokens cannot hold two of the long ones. A
    running prefill of a shared prefix defers the requests sharing it (`defer_shared_prefill_tokens`), and the
    request behind them runs first. Shared by the examples while it holds nothing of the last one: requests a failed
    example left would run beside the next one's, their events taken for those of its requests of the same index."""
    swap = dict(preemption="swap", num_cpu_pages=64) if preemption == "swap" else {}
    return Engine(ensure_tiny_checkpoint(), EngineConfig(
        page_size=4, num_gpu_pages=pool_pages, max_model_len=96, kv_dtype="fp32", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=32, defer_shared_prefill_tokens=8, async_scheduling=async_scheduling,
        graph_rows_without_cuda=True, check_invariants=True, **swap))


_RUNS = itertools.count()


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, bool, list[tuple[int, int, dict, int]]]:
    """(preemption, async scheduling, requests as (text, max_tokens, penalties, step it arrives at)): two long
    requests sharing a prefix (the second deferred while the first computes it, so a request behind it runs first),
    too long to run together in the small pool, then up to five others."""
    long_max_tokens = draw(st.integers(24, 30))
    others = draw(st.lists(st.tuples(st.integers(0, len(TEXTS) - 1), st.integers(8, 30), st.sampled_from(PENALTIES),
                                     st.integers(0, 3)), max_size=5))
    requests = [(0, long_max_tokens, PENALTIES[0], 0), (1, long_max_tokens, PENALTIES[3], 1), *others]
    return draw(st.sampled_from(["swap", "recompute"])), draw(st.booleans()), requests


def served(engine: Engine, requests: list[tuple[int, int, dict, int]]) -> tuple[dict[int, list[int]], list[str]]:
    """Each request's tokens, the requests added as their steps come, from a cold prefix cache; and what broke the
    bound after a step, if anything: a request holding a slot of the count table while it does not run, or more
    slots held than max_num_seqs."""
    run, table = next(_RUNS), engine.penalty_counts
    engine.kv.clear_cache()
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    broken: list[str] = []
    step = 0
    while step <= max(arrival for *_, arrival in requests) or engine.has_unfinished_requests():
        for i, (text, max_tokens, knobs, arrival) in enumerate(requests):
            if arrival == step:
                engine.add_request(f"{run}/{i}", TEXTS[text], SamplingParams.greedy(
                    max_tokens=max_tokens, ignore_eos=True, **knobs))
        for event in engine.step():
            i = int(event.request_id.split("/")[1])
            tokens[i].extend(event.new_token_ids)
            assert not event.finished or event.finish_reason is FinishReason.LENGTH, (i, event.error)
        holders = sorted((r.request_id, r.state.value) for r in engine.requests.values()
                         if r._penalty_counts is not None and r._penalty_counts.table is table)
        if any(state != "running" for _, state in holders) or len(holders) > MAX_NUM_SEQS:
            broken.append(f"step {step}: slots held by {holders}, {table.in_use} in use")
        step += 1
    return tokens, broken


def served_with_preemptions(scenario) -> tuple[dict[int, list[int]], list[str]]:
    """`served` on the small pool of the scenario's preemption mode, which must preempt."""
    preemption, async_scheduling, requests = scenario
    small = engine(24, preemption, async_scheduling)
    preemptions = small.stats.preemptions
    served_ = served(small, requests)
    hypothesis.event(f"{small.stats.preemptions - preemptions} preemptions")
    assert small.stats.preemptions > preemptions, "the spec needs preemptions"
    return served_


ENGINE_STEPS = settings(max_examples=12, deadline=None)


@ENGINE_STEPS
@given(scenario=scenarios())
def spec_only_running_requests_hold_slots(scenario) -> None:
    _, broken = served_with_preemptions(scenario)
    assert not broken, f"a slot held by a request not running, or more than {MAX_NUM_SEQS}: {broken[:3]}"


@ENGINE_STEPS
@given(scenario=scenarios())
def spec_a_preempted_request_samples_as_undisturbed(scenario) -> None:
    got, _ = served_with_preemptions(scenario)
    preemption, _, requests = scenario
    want, _ = served(engine(256, "recompute", False), requests)
    for i, request in enumerate(requests):
        assert got[i] == want[i], (
            f"request {i} {request} gave {got[i]} in a pool that preempted it ({preemption}), {want[i]} alone")
