"""`prism.LLM`: the offline API over the engine (generate a batch, or stream one request)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decision.plan import Generations, Outcome, Readouts, advance, plan_decision
from ..decision.questions import Answer, Question
from ..decision.thinking import ThinkingConfig
from .config import EngineConfig
from .engine import Engine
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

    def generate(
        self, prompts: PromptLike | Sequence[PromptLike], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run all prompts to completion with continuous batching; results in prompt order."""
        if isinstance(prompts, (str, PreparedPrompt)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [self._add(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        results = {i: None for i in ids}
        completions: dict[str, Completion] = {}
        while any(results[i] is None for i in ids):
            for event in self.engine.step():
                self._accumulate(completions, event)
                if event.finished:
                    results[event.request_id] = completions[event.request_id]
        return [results[i] for i in ids]

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
        return {rid: Outcome(c.readout, c.token_ids, c.prompt_tokens, c.cached_tokens, c.error) for rid, c in done.items()}

    def _run_until_finished(self, request_ids: list[str]) -> dict[str, Completion]:
        """Step until every listed request finished; their accumulated outputs."""
        completions: dict[str, Completion] = {}
        done: set[str] = set()
        while len(done) < len(request_ids):
            for event in self.engine.step():
                if event.request_id in request_ids:
                    self._accumulate(completions, event)
                    if event.finished:
                        done.add(event.request_id)
                        completions[event.request_id].readout = event.readout
        return completions

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Events of one request as the engine produces them (other requests may share the steps)."""
        request_id = self._add(prompt, params)
        try:
            while True:
                for event in self.engine.step():
                    if event.request_id == request_id:
                        yield event
                        if event.finished:
                            return
        finally:
            self.engine.abort(request_id)  # a consumer that stops early cancels the request

    def _add(self, prompt: PromptLike, params: SamplingParams | None) -> str:
        request_id = f"llm-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, params)
        return request_id

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
