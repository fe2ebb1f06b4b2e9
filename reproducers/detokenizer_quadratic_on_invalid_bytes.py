"""The incremental detokenizer decoded, at each token, the window of tokens since its last clean boundary, and held
that window while its text ended in U+FFFD: over a run of tokens that never ends a character (here 2,000 lone
continuation bytes, each its own U+FFFD), it decoded the whole run again at every token, about n^2 / 2 ids for n
tokens (2 million here). Fixed when each token's bytes go through one incremental UTF-8 decoder: one look-up of its
bytes per token (`IncrementalDetokenizer`, `ByteLevelVocab`)."""

import _common
from specs.spec_detokenizer_work import WORK_PER_TOKEN, CountingTokenizer  # noqa: E402

from prism.engine.detokenize import IncrementalDetokenizer  # noqa: E402
from prism.testing.tokenizer import build_bpe_tokenizer  # noqa: E402

tok = CountingTokenizer(build_bpe_tokenizer(400))
continuation = tok.token_to_id("¿")  # the byte 0xbf
assert tok.decode([continuation]) == "\ufffd", "premise: a byte that is no character alone"
tokens = [continuation] * 2000
detok = IncrementalDetokenizer(tok, tok.encode("Hi").ids)  # type: ignore[arg-type]
text = "".join(detok.add(t) for t in tokens) + detok.flush()
assert text == "\ufffd" * len(tokens), "the text is not the decode of the tokens"
_common.verdict(tok.work <= WORK_PER_TOKEN * len(tokens),
                f"{len(tokens)} tokens cost the tokenizer {tok.work} units of work (ids decoded, tokens looked up)",
                f"{len(tokens)} tokens cost the tokenizer {tok.work} units of work (ids decoded, tokens looked up): "
                f"quadratic, more than {WORK_PER_TOKEN} per token")
