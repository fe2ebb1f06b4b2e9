"""Found by review (session 33): gated thinking took a reasoning generation's tokens whatever its end. A reasoning the
engine failed (here its step fails after its first token) was re-read as it stood, one token long, and the question
answered as if it had thought (`thought: true`, a 200 over HTTP). Fixed: `decision.plan.reasoning_tokens` fails the
question (`DecisionFailed`, the server's 500 naming a request id) when its reasoning was failed or aborted."""

import _common  # noqa: F401

from prism.decision.plan import DecisionFailed  # noqa: E402
from prism.decision.questions import Question  # noqa: E402
from prism.decision.thinking import ThinkingConfig  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=4, num_gpu_pages=64, async_scheduling=False)
execute = llm.engine.runner.execute


def fails_the_reasoning_after_its_first_token(slices, *args, **kwargs):
    if any(s.request.request_id.endswith("/think") and s.request.output_token_ids for s in slices):
        llm.engine.runner.execute = execute
        raise RuntimeError("simulated device failure")
    return execute(slices, *args, **kwargs)


llm.engine.runner.execute = fails_the_reasoning_after_its_first_token
try:
    (answer,) = llm.decide([{"role": "user", "content": "The lamp is on."}], [Question("yes_no", "Is the lamp on?")],
                           ThinkingConfig(gate=1.0, max_tokens=8))
except DecisionFailed as error:
    _common.verdict(True, f"the decide failed: {error}", "")
_common.verdict(False, "", f"answered {answer.answer!r} (thought={answer.thought}, {answer.thinking_tokens} token of "
                           "reasoning) although its reasoning failed")
