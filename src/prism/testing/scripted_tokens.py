"""An engine that generates the tokens a test chose: the text-side specs (stop strings, detokenizing) need given bytes
out of a random-weight model. Owns no invariant; everything else (scheduling, KV, async steps, the streams, the
sampler itself on the rows it is given) runs as it does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch


@contextmanager
def scripted_tokens(engine, tokens_of: Callable[[str], Sequence[int]],
                    alternatives_of: Callable[[str], Sequence[Mapping[int, float]]] | None = None) -> Iterator[None]:
    """Inside the block, the k-th token `engine` samples for a request is `tokens_of(request_id)[k]`: each logits row
    is made one-hot on it before the engine's own sampling. A row launched for a request that then stopped still
    counts, which changes nothing: the request asks for no more tokens. `alternatives_of(request_id)[k]`, when given,
    are other tokens the k-th row makes possible, by their logits (below 0, the scripted token's: it stays the
    argmax), so that logprobs have alternatives to list."""
    own = vars(engine).get("_sample")
    sample = engine._sample
    sampled: Counter[str] = Counter()

    def scripted(slices, logits: torch.Tensor):
        chosen = torch.full_like(logits, float("-inf"))
        for row, s in enumerate(slices):
            request_id = s.request.request_id
            for token, logit in (alternatives_of(request_id)[sampled[request_id]] if alternatives_of else {}).items():
                chosen[row, token] = logit
            chosen[row, tokens_of(request_id)[sampled[request_id]]] = 0.0
            sampled[request_id] += 1
        return sample(slices, chosen)

    engine._sample = scripted
    try:
        yield
    finally:
        if own is None:
            del engine._sample
        else:
            engine._sample = own
