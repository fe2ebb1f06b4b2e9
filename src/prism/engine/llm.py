"""`prism.LLM`: the offline API over the engine (generate a batch, stream requests, decide).

Owns the routing of the engine's events to the calls that wait for them: every request an `LLM` call makes gets a
mailbox, and each engine step's events go to their requests' mailboxes, so calls that share the engine (two
streams read in turn, a `generate` or a `decide` while a stream is open) each receive all of their own events and
none of another's. (The engine's `step` returns the events of every request: a call that kept only its own lost
the others', and a stream whose last event another call had taken waited for ever.)
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decision.plan import Generations, Outcome, Readouts, advance, plan_decision
from ..decision.questions import Answer, Question
from ..decision.thinking import ThinkingConfig
from .config import EngineConfig
from .engine import Engine, RequestError
from .inputs import PreparedPrompt
from .request import FinishReason, RequestOutput, TokenLogprobs
from .sampling import SamplingParams

PromptLike = PreparedPrompt | str | list[dict]


@dataclass
class Completion:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    readout: list[float] | None = None


class LLM:
    """`LLM(model_dir, **config)`; config keys are EngineConfig fields (unknown keys are rejected)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, **overrides: Any) -> None:
        base = config or EngineConfig()
        self.engine = Engine(model_dir, base.replace(**overrides) if overrides else base)
        self._ids = itertools.count()
        self._mailboxes: dict[str, deque[RequestOutput]] = {}  # the events of requests a call still reads
        # Streams dropped unread, to abort before the next step: a finalizer may run inside a step (the cyclic
        # garbage collector), where an abort would release a sequence the step is using.
        self._abandoned: list[str] = []

    def generate(
        self, prompts: PromptLike | Sequence[PromptLike], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run all prompts to completion with continuous batching; results in prompt order. A prompt the engine
        refuses refuses the whole call: the prompts added before it are aborted."""
        if isinstance(prompts, dict):  # its keys would be taken as prompts
            raise RequestError("one chat message is not a prompt: pass a conversation as a list of messages "
                               "([message, ...]), or several as a list of those")
        if isinstance(prompts, (str, PreparedPrompt)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        try:
            prompts = list(prompts)
        except TypeError:
            raise RequestError(f"prompts must be a prompt or an iterable of prompts, got {type(prompts).__name__}"
                               ) from None
        params_list = [params] * len(prompts) if params is None or isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params_list, strict=True):
                ids.append(self._add(p, sp))
        except BaseException:
            for request_id in ids:
                self._forget(request_id)
            raise
        done = self._run_until_finished(ids)
        return [done[i] for i in ids]

    def decide(
        self, material: list[dict], questions: Sequence[Question], thinking: ThinkingConfig | None = None
    ) -> list[Answer]:
        """Several questions over one material (chat messages with images/text): the material is
        prefilled once, each question forks from it, and each answer is read as probabilities. With
        `thinking`, a question below the confidence gate reasons (seeded by its own text) and is read again."""
        plan = plan_decision(f"decide-{next(self._ids)}", material, list(questions), self.engine.inputs, thinking,
                             self.engine.max_prompt_tokens)
        state, value = advance(plan, None)
        while state == "work":
            state, value = advance(plan, self._run_work(value))
        return value

    def _run_work(self, work: Readouts | Generations) -> dict[str, Outcome]:
        engine = self.engine
        if isinstance(work, Readouts) and work.decision_id is not None:
            ids = engine.add_decision(work.decision_id, work.branches)
        elif isinstance(work, Readouts):
            ids = [engine.add_readout_request(b.request_id, b.prompt, b.candidates, b.temperature).request_id
                   for b in work.branches]
        else:
            ids = [engine.add_request(rid, prompt, params).request_id for rid, prompt, params in work.requests]
        done = self._run_until_finished(ids)
        return {rid: Outcome(c.readout, c.token_ids, c.prompt_tokens, c.cached_tokens, c.error,
                             c.finish_reason is FinishReason.ABORT) for rid, c in done.items()}

    def _run_until_finished(self, request_ids: list[str]) -> dict[str, Completion]:
        """Step until every listed request finished; their accumulated outputs (their mailboxes closed). A request
        added to the engine directly gets its mailbox here: its events from the next step on."""
        completions: dict[str, Completion] = {}
        waiting = set(request_ids)
        for request_id in request_ids:
            self._mailboxes.setdefault(request_id, deque())
        try:
            while waiting:
                for request_id in list(waiting):
                    box = self._mailboxes[request_id]
                    while box:
                        event = box.popleft()
                        self._accumulate(completions, event)
                        if event.finished:
                            completions[request_id].readout = event.readout
                            waiting.discard(request_id)
                            del self._mailboxes[request_id]
                            break
                if waiting:
                    self._step_for(waiting)
        finally:
            for request_id in waiting:  # an error (or an interrupt) leaves nothing running for no one
                self._forget(request_id)
        return completions

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None) -> RequestStream:
        """The events of one request, which starts now, as the engine produces them (other requests, other
        streams' included, may share the steps). Closing the stream (or dropping it) before its last event
        aborts the request."""
        return RequestStream(self, self._add(prompt, params))

    def _add(self, prompt: PromptLike, params: SamplingParams | None) -> str:
        request_id = f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params)
        self._mailboxes[request_id] = deque()
        return request_id

    def _next_event(self, request_id: str) -> RequestOutput:
        box = self._mailboxes[request_id]
        while not box:
            self._step_for((request_id,))
        return box.popleft()

    def _step_for(self, request_ids) -> None:
        """One engine step for requests still waiting for events; each event goes to its request's mailbox (a
        request no call reads any more, such as a closed stream's, has none: its events are dropped)."""
        while self._abandoned:
            self._forget(self._abandoned.pop())
        if not self.engine.has_unfinished_requests():
            raise RuntimeError(f"requests {sorted(request_ids)} are owed events the engine no longer has: "
                               "something else stepped this LLM's engine directly and took them")
        for event in self.engine.step():
            box = self._mailboxes.get(event.request_id)
            if box is not None:
                box.append(event)

    def _forget(self, request_id: str) -> None:
        """No call reads `request_id` any more: abort it if it still runs, and drop its events."""
        self._mailboxes.pop(request_id, None)
        self.engine.abort(request_id)

    @staticmethod
    def _accumulate(completions: dict[str, Completion], event: RequestOutput) -> None:
        c = completions.setdefault(
            event.request_id, Completion(event.request_id, event.prompt_tokens, event.cached_tokens)
        )
        c.token_ids += event.new_token_ids
        c.text += event.new_text
        c.cached_tokens = event.cached_tokens
        if event.logprobs is not None:
            c.logprobs = (c.logprobs or []) + event.logprobs
        if event.finished:
            c.finish_reason, c.error = event.finish_reason, event.error


class RequestStream:
    """The events of one request (`LLM.stream`), an iterator that ends after the terminal event. `close()` before
    that aborts the request; dropping the stream aborts it before the LLM's next step."""

    def __init__(self, llm: LLM, request_id: str) -> None:
        self._llm = llm
        self.request_id = request_id
        self._open = True

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        if not self._open:
            raise StopIteration
        try:
            event = self._llm._next_event(self.request_id)
        except BaseException:
            self.close()
            raise
        if event.finished:
            self._open = False
            self._llm._mailboxes.pop(self.request_id, None)
        return event

    def close(self) -> None:
        if self._open:
            self._open = False
            self._llm._forget(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unread: aborted before the LLM's next step, not here (this may run inside a step).
        if self._open:
            self._open = False
            self._llm._abandoned.append(self.request_id)
