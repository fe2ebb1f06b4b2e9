"""What rank 0 still holds when it leaves its tensor-parallel group: the check behind the TP2 shutdown hang.

On two H200s (NCCL 2.28, torch 2.11) both ranks of a TP2 engine hung forever at shutdown, in
`destroy_process_group` and then in the abort that replaced it: a CUDA graph that captured an NCCL collective
holds a reference on its communicator, and NCCL's teardown waits until every such graph is destroyed. A rank
must destroy its graphs before it leaves (`engine/tp_workers.leave_group`). On the CPU no graph captures a
collective, but the runner's graph holders exist (`graph_rows_without_cuda`), so the order is checkable there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GRAPH_HOLDERS = ("graphs", "packed", "vision_graphs")


@dataclass
class GroupExit:
    left: bool = False  # the communicators were aborted at all
    finished_in_time: bool = False  # the engine's shutdown reported its leaving the group done in time
    graphs_held: list[str] = field(default_factory=list)  # the runner's graph holders alive at that moment


def shutdown_recording_group_exit(engine) -> GroupExit:
    """Shut `engine` (rank 0 of a TP group) down, recording its runner's graph holders at the moment its
    communicators are aborted."""
    from ..engine import tp_workers

    seen = GroupExit()
    original = tp_workers.abort_process_group

    def recording_abort() -> None:
        seen.left = True
        seen.graphs_held = [name for name in GRAPH_HOLDERS
                            if getattr(engine.runner, name, None) is not None
                            and not getattr(getattr(engine.runner, name), "released", False)]
        original()

    tp_workers.abort_process_group = recording_abort
    try:
        seen.finished_in_time = engine.shutdown()
    finally:
        tp_workers.abort_process_group = original
    return seen
