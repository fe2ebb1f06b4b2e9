"""Found by review (session 28): `SamplingParams.seed` takes 0 .. 2**64 - 1, but a CPU generator keeps a seed's low
32 bits: seed 1 and seed 2**32 + 1 sampled the same tokens (and over HTTP, where -1 means 2**64 - 1, seeds -1 and
2**32 - 1). Now seeds past 2**32 - 1 are hashed to 32 bits (`sampler.generator_seed`)."""

from __future__ import annotations

import _common  # noqa: F401 - makes `prism` importable
import torch

from prism.engine.sampler import make_generator
from prism.engine.sampling import SamplingParams


def draws(seed: int) -> list[float]:
    return torch.rand(8, generator=make_generator(SamplingParams(temperature=1.0, seed=seed))).tolist()


alike = [(a, b) for a, b in ((1, 1 + 2**32), (2**32 - 1, 2**64 - 1), (2**63 - 1, 2**64 - 1)) if draws(a) == draws(b)]
_common.verdict(not alike, "seeds that differ only above bit 32 draw differently",
                f"these seeds draw the same numbers: {alike}")
