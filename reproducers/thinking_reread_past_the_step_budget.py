"""Found by review (session 22), after the fix of `thinking_reread_past_max_model_len.py`: the reasoning was cut to
fit max_model_len only, but with chunked prefill off a prompt must also fit one step (max_num_batched_tokens), so
the re-read could still be refused and the decide failed after it had run. Fixed when the cap is the engine's
own longest accepted prompt (`Engine.max_prompt_tokens`)."""

import _common  # noqa: F401
from specs.spec_decision_liveness import MATERIAL  # noqa: E402

from prism.decision.questions import Question  # noqa: E402
from prism.decision.thinking import ThinkingConfig  # noqa: E402
from prism.engine.engine import RequestError  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256, max_model_len=1024,
          max_num_batched_tokens=256, enable_chunked_prefill=False)
try:
    (answer,) = llm.decide(MATERIAL, [Question("yes_no", "Is the lamp bright?")],
                           ThinkingConfig(gate=1.0, max_tokens=200))
    ok, detail = True, f"answered after {answer.thinking_tokens} tokens of reasoning"
except RequestError as error:
    ok, detail = False, f"the decide failed on its own re-read: {error}"
_common.verdict(ok, detail, detail)
