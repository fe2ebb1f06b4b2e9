"""Found by review (session 27): a gated-thinking re-read appended the reasoning generation's tokens as they were. A
hot reasoning (temperature 50) ended with the end-of-turn token, so the re-read read its answer after `<|im_end|>`,
outside the assistant's turn (and one that stopped on "Final answer:" would show the cue twice). Fixed by
`decision.thinking.reasoning_of`: the reasoning without its end-of-turn token or the cue's tokens."""

import _common  # noqa: F401

from prism.decision import plan  # noqa: E402
from prism.decision.questions import Question  # noqa: E402
from prism.decision.thinking import ThinkingConfig  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=64)
prompts = []
real = plan.answer_after_thinking
plan.answer_after_thinking = lambda prompt, reasoning, encode: prompts.append(real(prompt, reasoning, encode)) or prompts[-1]
material = [{"role": "user", "content": "Look at the sky."}]
llm.decide(material, [Question("yes_no", "Rain?")], ThinkingConfig(gate=1.0, max_tokens=200, temperature=50.0, seed=2))
(reread,) = prompts
tail = llm.engine.inputs.decode(reread.token_ids[-12:], skip_special_tokens=False)
_common.verdict("<|im_end|>\nFinal answer:" not in tail and tail.count("Final answer:") == 1,
                f"the re-read ends {tail!r}", f"the re-read reads its answer after the end of the turn: {tail!r}")
