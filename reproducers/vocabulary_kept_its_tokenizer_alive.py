"""Found by the review of session 33: `detokenize.byte_level_vocab` caches each tokenizer's `ByteLevelVocab` in a
WeakKeyDictionary, but the vocabulary held its tokenizer strongly, so the entry kept its own key alive and no
tokenizer loaded was ever freed (30-70 MB per Qwen tokenizer loaded and dropped: tests and offline processes that
build many engines). Fixed when a dropped tokenizer is collected."""

import gc
import weakref

import _common  # noqa: F401

from prism.engine.detokenize import byte_level_vocab
from prism.testing.tokenizer import build_bpe_tokenizer

tok = build_bpe_tokenizer(300)
byte_level_vocab(tok)(5)
gone = weakref.ref(tok)
del tok
gc.collect()
_common.verdict(gone() is None, "a tokenizer dropped by its users is collected, its vocabulary with it",
                "a tokenizer dropped by its users stays alive: its cached vocabulary holds it")
