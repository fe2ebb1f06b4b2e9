"""Found by review (session 33): `decision/thinking.py` said a thinking question's reasoning could not be changed by
its siblings or batch companions, in any mode. Its seed is its own, but the logits it samples from, and the first
readout its gate reads, round differently with the batch outside deterministic mode: here, with the gate at the
question's own confidence, the same question thinks when asked alone and not beside two others (the strict `<` of
the gate decides on the last bits). Fixed in the docs: the independence is deterministic mode's only, where the
same decides think alike (checked below, and by `specs/spec_decision_thinking.py`)."""

import _common  # noqa: F401

from prism.decision import thinking  # noqa: E402
from prism.decision.questions import Question  # noqa: E402
from prism.decision.thinking import ThinkingConfig  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

MATERIAL = [{"role": "user", "content": "Read this note carefully: the lamp is on and the door is shut."}]
QUESTIONS = [Question("yes_no", "Is the lamp on?"), Question("score", "How bright is it?", levels=(1, 2, 3)),
             Question("choice", "Which is shut?", ("the lamp", "the door", "nothing"))]


def thinks_alone_and_together(deterministic: bool) -> tuple[bool, bool]:
    """Whether QUESTIONS[1] thinks alone and beside the others, the gate at the higher of its two confidences."""
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, deterministic=deterministic)

    def asked(questions, config=None):
        llm.engine.kv.clear_cache()  # every decide cold: only the companions differ
        return llm.decide(MATERIAL, questions, config)[questions.index(QUESTIONS[1])]

    config = ThinkingConfig(gate=max(asked([QUESTIONS[1]]).confidence, asked(QUESTIONS).confidence), max_tokens=4)
    return asked([QUESTIONS[1]], config).thought, asked(QUESTIONS, config).thought


default, deterministic = thinks_alone_and_together(False), thinks_alone_and_together(True)
claims_every_mode = "deterministic mode" not in thinking.__doc__
detail = (f"thought alone / beside two others: {default} in default mode, {deterministic} in deterministic mode; the "
          f"docs {'claim' if claims_every_mode else 'limit'} the independence {'in every mode' if claims_every_mode else 'to deterministic mode'}")
ok = deterministic[0] == deterministic[1] and (default[0] == default[1] or not claims_every_mode)
_common.verdict(ok, detail, detail)
