"""Found by review (session 33): a choice of more than 26 options whose final round (the group winners) is past the
engine's prompt limit was refused only when that round was built, after its groups had run, with an engine error
naming a request id (`.../q0final`), and only when its long options won their groups. Here each group of 27 options
(13 + 14) fits max_model_len, and the final round of its two long options does not. Fixed: `plan_decision` checks the
longest final round a grouped choice can reach before anything runs, and refuses the decide naming questions[0]."""

import _common  # noqa: F401

from prism.decision.plan import Outcome, advance, grouped, plan_decision  # noqa: E402
from prism.decision.questions import Question, QuestionError  # noqa: E402
from prism.engine.engine import RequestError  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

MATERIAL = [{"role": "user", "content": "Read this note: the lamp is on and the door is shut."}]
options = [f"short {k}" for k in range(27)]
options[0], options[13] = "a " * 150 + "first", "a " * 150 + "second"
question = Question("choice", "Which fits?", tuple(options))

probe = LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256)
groups = [len(probe.engine.inputs.prepare_chat([*MATERIAL, {"role": "user", "content": g.render()}]).token_ids)
          for g in grouped(question)]
llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, max_model_len=max(groups) + 4)
engine = llm.engine
plan = plan_decision("late", MATERIAL, [question], engine.inputs, max_prompt_tokens=engine.max_prompt_tokens)
try:
    _, round1 = advance(plan, None)
except QuestionError as error:
    _common.verdict(error.param == "questions[0]", f"refused before anything ran: {error}",
                    f"refused up front, but naming {error.param!r}: {error}")
engine.add_decision(round1.decision_id, round1.branches)
while engine.has_unfinished_requests():
    engine.step()
ran = engine.runner.stats.tokens_computed
long_options_win = ([1.0] + [0.0] * 12, [1.0] + [0.0] * 13)
_, round2 = advance(plan, {b.request_id: Outcome(readout=r) for b, r in zip(round1.branches, long_options_win, strict=True)})
try:
    engine.add_decision(round2.decision_id, round2.branches)
    detail = "its final round was accepted past max_model_len"
except RequestError as error:
    detail = f"refused after its groups ran ({ran} tokens computed, groups of {groups} tokens): {error}"
_common.verdict(False, "", detail)
