"""Rank 0 -> every rank: the control channel that carries each step's payload.

Owns *followers run exactly rank 0's steps, in rank 0's order*: one broadcast per step, from rank 0,
of a picklable object (the step payload, or None to shut down). It runs over gloo on the host even when
the data collectives use NCCL (a gloo side group), so control data never round-trips through a GPU.
"""

from __future__ import annotations

import torch.distributed as dist

from .tensor_parallel import TPGroup


class StepChannel:
    """Every rank must construct it at the same point (the gloo side group is created collectively)."""

    def __init__(self, group: TPGroup) -> None:
        self.rank = group.rank
        backend = str(dist.get_backend(group.group)).lower()
        self._group = group.group if backend == "gloo" else dist.new_group(backend="gloo")

    def send(self, payload: object) -> None:
        """Rank 0: broadcast `payload` (None means: stop serving)."""
        assert self.rank == 0, "only rank 0 sends steps"
        dist.broadcast_object_list([payload], src=0, group=self._group)

    def recv(self) -> object:
        """Follower ranks: the next payload rank 0 sent."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]
