"""Rank 0 -> every rank: the control channel that carries each step's payload.

Owns *followers run exactly rank 0's steps, in rank 0's order*: per step, rank 0 sends each follower its
picklable object (the step payload as that rank needs it, or None to shut down), point to point, in rank
order. It runs over gloo on the host even when the data collectives use NCCL (a gloo side group), so control
data never round-trips through a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from .tensor_parallel import TPGroup


class StepChannel:
    """Every rank must construct it at the same point (the gloo side group is created collectively)."""

    def __init__(self, group: TPGroup) -> None:
        self.rank = group.rank
        self.world_size = group.world_size
        backend = str(dist.get_backend(group.group)).lower()
        self._group = group.group if backend == "gloo" else dist.new_group(backend="gloo")

    def send(self, payload_for: Callable[[int], object]) -> None:
        """Rank 0: send follower r `payload_for(r)` (None means: stop serving)."""
        assert self.rank == 0, "only rank 0 sends steps"
        for rank in range(1, self.world_size):
            dist.send_object_list([payload_for(rank)], dst=self._global_rank(rank), group=self._group)

    def recv(self) -> object:
        """Follower ranks: the next payload rank 0 sent."""
        box: list[object] = [None]
        dist.recv_object_list(box, src=self._global_rank(0), group=self._group)
        return box[0]

    def _global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self._group, rank) if self._group is not None else rank
