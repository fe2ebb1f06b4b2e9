"""Rank 0 -> every rank: the control channel that carries each step's payload.

Owns *followers run exactly rank 0's steps, in rank 0's order*: per step, rank 0 sends each follower its
picklable object (the step payload as that rank needs it, or None to shut down), point to point, in rank
order. It runs over gloo on the host even when the data collectives use NCCL (a gloo side group), so control
data never round-trips through a GPU.

Also owns *an idle engine keeps its followers*: a follower waits for the next step with no time limit (`recv`),
since rank 0 may have none to send for hours. A bounded wait (gloo's receive times out after the group's timeout:
`distributed_timeout_s` on the CPU, 30 minutes for NCCL's gloo side group) made every follower of an engine idle
that long raise and exit, and the next request fail (`reproducers/tp_idle_engine_lost_its_followers.py`). The
wait still ends at once if rank 0's process dies (its sockets close) or leaves the group; the payload itself, sent
right after its length, is received within the group's timeout.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .tensor_parallel import TPGroup

# How long a follower waits for rank 0's next step: no limit in practice (gloo takes a timeout, not "none").
IDLE_WAIT = timedelta(days=365)


class StepChannel:
    """Every rank must construct it at the same point (the gloo side group is created collectively)."""

    def __init__(self, group: TPGroup) -> None:
        self.rank = group.rank
        self.world_size = group.world_size
        backend = str(dist.get_backend(group.group)).lower()
        self._group = group.group if backend == "gloo" else dist.new_group(backend="gloo")

    def send(self, payload_for: Callable[[int], object]) -> None:
        """Rank 0: send follower r `payload_for(r)` (None means: stop serving): its pickled length, then its bytes."""
        assert self.rank == 0, "only rank 0 sends steps"
        for rank in range(1, self.world_size):
            data = torch.frombuffer(bytearray(pickle.dumps(payload_for(rank))), dtype=torch.uint8)
            dst = self._global_rank(rank)
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=self._group)
            dist.send(data, dst=dst, group=self._group)

    def recv(self) -> object:
        """Follower ranks: the next payload rank 0 sent, waiting as long as rank 0 sends none (`IDLE_WAIT`)."""
        src = self._global_rank(0)
        size = torch.zeros(1, dtype=torch.int64)
        dist.irecv(size, src=src, group=self._group).wait(IDLE_WAIT)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=src, group=self._group)
        return pickle.loads(data.numpy().tobytes())

    def _global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self._group, rank) if self._group is not None else rank
