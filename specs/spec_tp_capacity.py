"""Spec of TP capacity (REFERENCE §2, invariant 10) and of encoder data parallelism, on the real code.

Ranks are threads exchanging values through a barrier (`prism.testing.thread_ranks`), so the real
`agree_num_pages` and `encode_media_items` run unmodified. Capacity: for any per-rank page counts, either
every rank gets the same count, the MIN (never more than its own), or every rank raises the same
KVCapacityError, and no rank is left waiting. Encoder DP: for any media items and world size, every item is
encoded by exactly one rank, the assignment is the same on every rank, and every rank ends with exactly the
replicated encoder's features in the original item order.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism.distributed import capacity, encoder_dp
from prism.distributed.tensor_parallel import TPGroup
from prism.model.vision import VisionOutput
from prism.testing.thread_ranks import ThreadWorld

PAGES = st.lists(st.integers(0, 64), min_size=1, max_size=4)


@settings(max_examples=150, report_multiple_bugs=False)
@given(local=PAGES)
def spec_every_rank_uses_the_min_or_all_fail_together(local: list[int]) -> None:
    world = ThreadWorld(len(local), timeout_s=5.0)
    results = world.run(lambda rank: capacity.agree_num_pages(rank, local[rank.rank]))
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1, f"ranks with pages {local} disagree on success: {results}"
    if min(local) == 0:
        assert kinds == {"error"}, f"pages {local}: a rank has no page, every rank must fail"
        errors = [e for _, e in results]
        assert all(isinstance(e, capacity.KVCapacityError) for e in errors), f"pages {local}: {errors}"
        assert len({str(e) for e in errors}) == 1, f"pages {local}: ranks fail with different errors"
    else:
        agreed = [v for _, v in results]
        assert kinds == {"ok"}, f"pages {local}: {results}"
        assert agreed == [min(local)] * len(local), f"pages {local}: ranks allocate {agreed}, not the MIN"


# ------------------------------------------------------------------------------------ encoder DP
MERGE, HIDDEN, DEEPSTACK = 2, 3, 2


class FakeVisionModel:
    """encode_media with the real output contract, each merged token's features a function of its patches."""

    config = SimpleNamespace(
        vision=SimpleNamespace(spatial_merge_size=MERGE, deepstack_visual_indexes=tuple(range(DEEPSTACK))),
        text=SimpleNamespace(hidden_size=HIDDEN),
    )
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int, int]]] = []

    def encode_media(self, pixels: torch.Tensor, grids) -> VisionOutput:
        self.calls.append([tuple(g) for g in grids])
        merged = pixels.view(-1, MERGE**2, HIDDEN).sum(1)
        deepstack = torch.stack([merged * (j + 2) for j in range(DEEPSTACK)])
        return VisionOutput(merged, deepstack, tuple(t * h * w // MERGE**2 for t, h, w in grids))


GRIDS = st.lists(st.tuples(st.integers(1, 2), st.integers(1, 3).map(lambda v: 2 * v), st.integers(1, 3).map(lambda v: 2 * v)),
                 min_size=0, max_size=7)


@settings(max_examples=100, report_multiple_bugs=False)
@given(grids=GRIDS, world_size=st.integers(1, 4), one_at_a_time=st.booleans())
def spec_encoder_dp_equals_the_replicated_encoder(grids, world_size, one_at_a_time) -> None:
    counts = [t * h * w for t, h, w in grids]
    owner = encoder_dp.assign_media(counts, world_size)
    assert len(owner) == len(grids) and all(0 <= r < world_size for r in owner)
    assert encoder_dp.assign_media(counts, world_size) == owner, "the assignment must be deterministic"
    g = torch.Generator().manual_seed(len(grids))
    pixels = [torch.randn(n, HIDDEN, generator=g) for n in counts]
    reference = encoder_dp.encode_media_items(FakeVisionModel(), grids, pixels, TPGroup.single())
    models = [FakeVisionModel() for _ in range(world_size)]
    world = ThreadWorld(world_size, timeout_s=5.0)
    results = world.run(lambda rank: encoder_dp.encode_media_items(models[rank.rank], grids, pixels, rank,
                                                                   one_at_a_time=one_at_a_time))
    encoded = sorted(g for m in models for call in m.calls for g in call)
    assert encoded == sorted(tuple(g) for g in grids), f"items {grids}: encoded {encoded}, each must be encoded once"
    for rank, (kind, value) in enumerate(results):
        assert kind == "ok", f"rank {rank}: {value!r}"
        assert len(value) == len(reference), f"rank {rank}: {len(value)} items, not {len(reference)}"
        for i, ((e, d), (re, rd)) in enumerate(zip(value, reference, strict=True)):
            same = e.shape == re.shape and d.shape == rd.shape
            assert same and torch.allclose(e, re, atol=1e-6) and torch.allclose(d, rd, atol=1e-6), (
                f"rank {rank}, item {i} of {grids}: features differ from the replicated encoder (order lost?)"
            )
