"""Found by review (session 27): a decision's questions are engine requests only once their shared material is
computed and they are forked from it. A material that ended otherwise (a failed step, or an abort when the client
left) left its questions without a terminal event: `LLM.decide` blamed another caller, and the server kept each
question's in-flight slot for good (enough abandoned decides and every request was a 429). Fixed: the material's
ending ends its unforked questions with its reason (`Engine._end_question`), and aborting one ends it."""

import _common  # noqa: F401

from prism.decision.plan import advance, plan_decision  # noqa: E402
from prism.decision.questions import Question  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=4, num_gpu_pages=64)
engine = llm.engine
material = [{"role": "user", "content": "Read this note carefully: the lamp is on and the door is shut."}]
_, work = advance(plan_decision("d", material, [Question("yes_no", f"Question {i}: is it bright?") for i in range(2)],
                                engine.inputs), None)
ids = engine.add_decision(work.decision_id, work.branches)
execute = engine.runner.execute


def fails_once(*args, **kwargs):
    engine.runner.execute = execute
    raise RuntimeError("simulated device failure")


engine.runner.execute = fails_once
ended = {}
for _ in range(30):
    for event in engine.step():
        if event.finished:
            ended[event.request_id] = event.finish_reason
missing = [i for i in ids if i not in ended]
_common.verdict(not missing and not engine.has_unfinished_requests(),
                f"both questions ended with their failed material: {[getattr(ended.get(i), 'value', None) for i in ids]}",
                f"questions {missing} never got a terminal event after their material failed")
