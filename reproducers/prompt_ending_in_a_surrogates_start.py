"""Found by the review of session 33: the detokenizer took a prompt's incomplete last character from Python's
incremental UTF-8 decoder, which holds ED A0..BF (an encoded surrogate's start) as if a character might complete.
Unicode's rule, and `tokenizers`' decode, call those two bytes invalid at once, so a token-id prompt ending in them
had its output's text start with two U+FFFD the decode of prompt + output lacks. Fixed when the text is the output's
own decode."""

import _common  # noqa: F401

from prism.engine.detokenize import IncrementalDetokenizer, byte_level_vocab
from prism.testing.tokenizer import build_bpe_tokenizer

tok = build_bpe_tokenizer(400)
vocab = byte_level_vocab(tok)
byte_ids = {vocab(i): i for i in range(tok.get_vocab_size()) if len(vocab(i)) == 1}
prompt, output = [byte_ids[b"\xed"], byte_ids[b"\xa0"]], tok.encode("A").ids
stream = IncrementalDetokenizer(tok, prompt)
text = "".join(stream.add(t) for t in output) + stream.flush()
_common.verdict(tok.decode(prompt) + text == tok.decode(prompt + output),
                f"after a prompt ending in ED A0 the text is {text!r}, the output's own decode",
                f"after a prompt ending in ED A0 the text is {text!r}, not {tok.decode(output)!r}: "
                f"prompt + text {tok.decode(prompt) + text!r} != {tok.decode(prompt + output)!r}")
