"""Found by review (session 28): `LLM.generate({"role": "user", "content": ...})`, one message where a conversation
(a list of messages) belongs, generated two completions without an error: the dict's keys "role" and "content" were
taken as two raw prompts. Now a RequestError says what a prompt is."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable

from prism.engine.engine import RequestError
from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=64)
try:
    out = llm.generate({"role": "user", "content": "Describe the weather"}, SamplingParams(max_tokens=3))
    outcome = f"{len(out)} completions (of the prompts {[c.prompt_tokens for c in out]} tokens long)"
except RequestError as error:
    outcome = None
    message = str(error)
_common.verdict(outcome is None, f"refused: {message if outcome is None else ''}",
                f"one message dict was generated as {outcome}")
