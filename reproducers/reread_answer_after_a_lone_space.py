"""Found by review (session 33): a gated-thinking re-read ended its prompt with the cue "\\nFinal answer: ", whose
trailing space Qwen's tokenizer makes a token of its own, and read "Yes" / "No" / "A"... after it: where the text
"Final answer: Yes" never has them (" Yes" is one token), so the re-read asked the model for a token sequence its
tokenizer never produces. Fixed: the cue ends with a newline ("\\nFinal answer:\\n"), after which a word, a letter or a
digit starts a token, as after the first readout's "assistant\\n"."""

import _common  # noqa: F401
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from prism.decision.questions import Question, candidate_token_ids  # noqa: E402
from prism.decision.thinking import THINKING_PREAMBLE, answer_after_thinking  # noqa: E402
from prism.engine.prompt import PreparedPrompt  # noqa: E402
from prism.testing.tokenizer import find_qwen_tokenizer_files  # noqa: E402

qwen = Tokenizer.from_file(str(find_qwen_tokenizer_files() / "tokenizer.json"))


def encode(text: str) -> list[int]:
    return qwen.encode(text, add_special_tokens=False).ids


asked = encode("<|im_start|>assistant\n")
prompt = PreparedPrompt(asked, torch.zeros(len(asked), dtype=torch.int64), torch.arange(len(asked)).expand(3, -1), 0, ())
reasoning = encode("The lamp is on, so yes.")
reread = answer_after_thinking(prompt, reasoning, encode).token_ids
cue = reread[len(asked) + len(encode(THINKING_PREAMBLE)) + len(reasoning):]
wrong = []
for question in (Question("yes_no", "Is it on?"), Question("choice", "Which?", ("on", "off"))):
    for label, candidate in zip(question.labels, candidate_token_ids(question, encode), strict=True):
        written = encode(qwen.decode(cue, skip_special_tokens=False) + label)
        if written != cue + [candidate]:
            wrong.append(f"{label!r} read as {qwen.id_to_token(candidate)!r} after {[qwen.id_to_token(t) for t in cue]}, "
                         f"written {[qwen.id_to_token(t) for t in written[len(cue) - 1:]]}")
_common.verdict(not wrong, f"the re-read's cue {[qwen.id_to_token(t) for t in cue]} ends where its answers start a token",
                "; ".join(wrong))
