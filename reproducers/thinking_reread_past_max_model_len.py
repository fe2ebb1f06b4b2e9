"""Found by review (session 22): gated thinking gave the reasoning its `max_tokens` whatever the prompt's length,
so near max_model_len the re-read (question + reasoning + answer cue), a prompt the client never sent, was longer
than the engine takes and the decide failed with "the prompt has N tokens; max_model_len is M". Fixed when the
reasoning is cut to the tokens its re-read leaves (none: the question keeps its first readout)."""

import _common  # noqa: F401
from specs.spec_decision_liveness import MATERIAL, engine_under_test  # noqa: E402

from prism.decision.questions import Question  # noqa: E402
from prism.decision.thinking import ThinkingConfig  # noqa: E402
from prism.engine.engine import RequestError  # noqa: E402

question = Question("yes_no", "Is the lamp " + "very " * 50 + "bright?")  # ~215 of max_model_len's 256 tokens
try:
    (answer,) = engine_under_test().decide(MATERIAL, [question], ThinkingConfig(gate=1.0, max_tokens=128))
    ok, detail = True, f"answered after {answer.thinking_tokens} tokens of reasoning (thought: {answer.thought})"
except RequestError as error:
    ok, detail = False, f"the decide failed on its own re-read: {error}"
_common.verdict(ok, detail, detail)
