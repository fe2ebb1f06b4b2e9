"""The request state machine and the events a request emits.

Owns *liveness* at the request level (invariant 9): the allowed transitions are one explicit table;
every accepted request reaches exactly one terminal state (FINISHED), and `finish` is the only way
there, so exactly one terminal event is produced.

    WAITING --schedule--> RUNNING --finish--> FINISHED
    RUNNING --preempt (recompute)--> WAITING          any non-terminal --abort/error--> FINISHED
    RUNNING --preempt (swap)--> SWAPPED --resume--> RUNNING

A request holds a slot of the engine's penalty count table only while it runs: every transition out of RUNNING
gives it back (`transition`), which bounds the slots in use by the requests running at a time (`penalty_counts`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from .penalties import TokenHistory, distinct_token_ids
from .penalty_counts import CountsSlot


class RequestError(ValueError):
    """A request that cannot be accepted (bad id, empty or too long prompt...)."""


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the caller (or client disconnect)
    ERROR = "error"  # could not be served (the message says why)


_ALLOWED = {
    RequestState.WAITING: {RequestState.RUNNING, RequestState.FINISHED},
    RequestState.RUNNING: {RequestState.WAITING, RequestState.SWAPPED, RequestState.FINISHED},
    # SWAPPED -> WAITING: a swapped request whose GPU-resident shared pages an older request needs is
    # dropped to recompute (scheduler._preempt_swapped).
    RequestState.SWAPPED: {RequestState.RUNNING, RequestState.WAITING, RequestState.FINISHED},
    RequestState.FINISHED: set(),
}


_CREATION_ORDER = itertools.count()


class RequestStateError(RuntimeError):
    """A transition outside the table: always a bug in the scheduler."""


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """One event of a request: new tokens/text, and on the last event `finish_reason`."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    readout: list[float] | None = None  # probabilities over the request's candidate tokens
    # A copy of the request's times on its first token's event and on its terminal event (None on the others): what
    # the server's queue / prefill histograms read, without a reference to the engine thread's mutable record.
    times: RequestTimes | None = None

    @classmethod
    def of(cls, request: Request, new_tokens: list[int], text: str,
           logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        """The event carrying `new_tokens` / `text` of `request`, with its state and counts as they are now."""
        return cls(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            error=request.error,
            logprobs=logprobs,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.cached_tokens,
            completion_tokens=len(request.output_token_ids),
            readout=request.readout,
            times=(replace(request.times)
                   if request.is_finished or (new_tokens and len(request.output_token_ids) == len(new_tokens))
                   else None),
        )


@dataclass(frozen=True)
class Branch:
    """One question forked from a material: its full prompt and its readout candidates."""

    request_id: str
    prompt: object  # PreparedPrompt: the material's tokens, then the question's
    candidates: tuple[int, ...]
    temperature: float = 1.0


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class Request:
    """One generation request as the engine tracks it (the KV side lives in the KV manager)."""

    def __init__(self, request_id: str, prompt, params, arrival_order: int) -> None:
        self.request_id = request_id
        self.prompt = prompt  # PreparedPrompt
        self.params = params  # SamplingParams
        self.arrival_order = arrival_order  # FCFS: lower is older (decision branches share their material's)
        # A total order even among equal arrivals: preemption needs a strictly younger victim, and two
        # requests of equal priority could otherwise each wait for the other on a full pool.
        self.priority = (arrival_order, next(_CREATION_ORDER))
        self.state = RequestState.WAITING
        self.output_token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        # Digests of its media sent to the encoder in steps before its admission (encoding ahead): each at most
        # once, so a request is held back at most once per media item.
        self.media_sent_ahead: set[bytes] = set()
        self.num_preemptions = 0
        self.times = RequestTimes()
        # A readout request ends at its last prompt position with probabilities over these token ids.
        self.readout_candidates: tuple[int, ...] | None = None
        self.readout_temperature = 1.0
        self.readout: list[float] | None = None
        # A material request: once its prefill is computed, these branches fork from it (see Engine.add_decision).
        self.branches: list[Branch] | None = None
        # The chain keys of its prompt's full pages (`kv.keys.chain_keys`), made once when the scheduler first
        # compares its prompt with another's.
        self.prompt_page_keys: list[bytes] | None = None
        self._distinct_prompt_ids: np.ndarray | None = None  # made once, when a penalty first reads them
        # Its row of the engine's penalty count table: taken on its first penalized sample since it last started
        # running, given back when it stops running (`transition`).
        self._penalty_counts: CountsSlot | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.prompt.token_ids) + self.output_token_ids

    def token_history(self) -> TokenHistory:
        """What its penalties read when its next token is sampled: its prompt's distinct ids and every token it has
        output, with its count slot (which counts only the tokens appended since its last sample). Complete then
        under async scheduling too: the engine appends the tokens of the step in flight (`Engine._accept_tokens`)
        before it samples the step launched on them."""
        if self._distinct_prompt_ids is None:
            self._distinct_prompt_ids = distinct_token_ids(self.prompt.token_ids)
            self._penalty_counts = CountsSlot()
        return TokenHistory(self._distinct_prompt_ids, self.output_token_ids, self._penalty_counts)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (a decode step asks for one id per sequence)."""
        prompt = self.prompt.token_ids
        n = len(prompt)
        if end <= start:
            return []
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return list(prompt[start:end]) + self.output_token_ids[: max(0, end - n)]

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def media_encoded_ahead(self) -> bool:
        """Some of its media were encoded ahead of its admission."""
        return bool(self.media_sent_ahead)

    def transition(self, new: RequestState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RequestStateError(f"request {self.request_id}: {self.state.value} -> {new.value} is not allowed")
        self.state = new
        if new is not RequestState.RUNNING and self._penalty_counts is not None:
            # Preempted (swapped out, or dropped to recompute) or finished: its slot goes back, so that waiting
            # requests hold none. Resumed, its next penalized sample takes a fresh one, filled from its whole history.
            self._penalty_counts.release()

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.transition(RequestState.FINISHED)
        self.finish_reason = reason
        self.error = error
        self.times.finished = time.perf_counter()

    def finish_reason_after(self, token: int, stopped_by_text: bool, eos_token_ids: Collection[int],
                            max_model_len: int) -> FinishReason | None:
        """Why this request ends with `token` (already appended to its output), or None if it goes on: a stop
        string or stop token, EOS (unless ignored), `max_tokens`, or the model's length (a length end still becomes
        a stop when the stream's last text completes a stop string: `Engine._last_text`)."""
        params = self.params
        if stopped_by_text or token in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token in eos_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if len(self.prompt.token_ids) + len(self.output_token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None


def material_length(branches: list[Branch]) -> int:
    """How many leading tokens a decision's branches share as their material: their common token ids, leaving each
    at least its last token to compute, cut before the first media item that not every branch holds the same and
    whole inside it. Equal token ids are not equal pictures (an image's pad tokens are the same for any picture of
    its size: the material must not give one branch another's image), and a question's own image, after the
    material, is computed with the question."""
    prompts = [b.prompt.token_ids for b in branches]
    shared = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
    items = [{(m.start, m.end, m.span_digests) for m in b.prompt.media} for b in branches]
    common = set.intersection(*items)
    while True:
        cut = min((start for held in items for start, end, digests in held
                   if start < shared and (end > shared or (start, end, digests) not in common)), default=None)
        if cut is None:
            return shared
        shared = cut
