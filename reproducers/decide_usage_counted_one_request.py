"""Found by review (session 33): a decide's usage counted one engine request per question: a grouped choice (30
options: two groups, then a final round) only its final round's prompt; a thinking question only its first readout's,
not its reasoning's prompt and generated tokens nor its re-read. Fixed: each answer's usage sums every engine request
made for its question, and a decide's (`usage` over HTTP, with `completion_tokens`) is the sum of its answers'. The
engine's own terminal events are the reference (`specs/spec_decision_usage.py`)."""

import _common  # noqa: F401
from specs.spec_decision_usage import USAGE, engine_usage  # noqa: E402

from prism.decision.questions import Question  # noqa: E402
from prism.decision.thinking import ThinkingConfig  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=4, num_gpu_pages=256)
with engine_usage(llm) as usage:
    answers = llm.decide([{"role": "user", "content": "The lamp is on."}],
                         [Question("yes_no", "Is the lamp on?"),
                          Question("choice", "Which word fits?", tuple(f"word {k}" for k in range(30)))],
                         ThinkingConfig(gate=1.0, max_tokens=6))
reported = {i: {key: getattr(a, key, 0) for key in USAGE} for i, a in enumerate(answers)}
_common.verdict(reported == usage, f"each answer's usage is its engine requests': {reported}",
                f"the answers report {reported}, their engine requests used {dict(usage)}")
