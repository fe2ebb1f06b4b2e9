"""`prism.LLM`: the offline API over the engine (generate a batch, or stream one request)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..decision.questions import Answer, Question, candidate_token_ids, make_answer
from ..decision.thinking import ThinkingConfig, answer_after_thinking, thinking_request
from .config import EngineConfig
from .engine import Engine
from .inputs import PreparedPrompt
from .request import Branch, FinishReason, RequestOutput, TokenLogprobs
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
        inputs = self.engine.inputs
        decision_id = f"decide-{next(self._ids)}"
        branches = []
        for i, question in enumerate(questions):
            prompt = inputs.prepare_chat([*material, {"role": "user", "content": question.render()}])
            candidates = candidate_token_ids(question, inputs.encode)
            branches.append(Branch(f"{decision_id}/q{i}", prompt, candidates, question.temperature))
        finals = self._run_until_finished(self.engine.add_decision(decision_id, branches))
        answers = [self._answer(i, q, finals[b.request_id]) for i, (q, b) in enumerate(zip(questions, branches, strict=True))]
        if thinking is None:
            return answers
        doubtful = [i for i, a in enumerate(answers) if a.confidence < thinking.gate]
        thoughts = {}
        for i in doubtful:
            prompt, params = thinking_request(branches[i].prompt, questions[i], thinking, inputs.encode)
            thoughts[i] = self._add(prompt, params)
        generated = self._run_until_finished(list(thoughts.values()))
        rereads = {}
        for i in doubtful:
            thought = generated[thoughts[i]].token_ids
            prompt = answer_after_thinking(branches[i].prompt, thought, inputs.encode)
            request_id = f"{decision_id}/q{i}/reread"
            self.engine.add_readout_request(request_id, prompt, branches[i].candidates, questions[i].temperature)
            rereads[i] = (request_id, len(thought))
        finals = self._run_until_finished([request_id for request_id, _ in rereads.values()])
        for i, (request_id, n_thought) in rereads.items():
            answer = self._answer(i, questions[i], finals[request_id])
            answer.thought, answer.thinking_tokens = True, n_thought
            answer.prompt_tokens, answer.cached_tokens = answers[i].prompt_tokens, answers[i].cached_tokens
            answers[i] = answer
        return answers

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

    @staticmethod
    def _answer(index: int, question: Question, completion: Completion) -> Answer:
        if completion.readout is None:
            raise RuntimeError(f"question {index} failed: {completion.error or completion.finish_reason}")
        answer = make_answer(index, question, completion.readout)
        answer.prompt_tokens, answer.cached_tokens = completion.prompt_tokens, completion.cached_tokens
        return answer

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
