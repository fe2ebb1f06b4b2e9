"""`prism.LLM`: the offline API over the engine (generate a batch, or stream one request)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
