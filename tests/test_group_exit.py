"""A tensor-parallel rank destroys its CUDA graphs before it leaves its group, and leaving is bounded.

The bug (two H200s, NCCL 2.28, torch 2.11): both ranks of a TP2 engine with CUDA graphs hung forever at shutdown,
since NCCL's teardown waits for every graph that captured one of its collectives to be destroyed
(`reproducers/tp_leave_group_with_live_graphs.py`). Checked here on two gloo ranks through the runner's graph
holders (`graph_rows_without_cuda`), with the bug planted once to show the check catches it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from prism.engine import tp_workers
from prism.engine.cuda_graphs import destroy_graphs
from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.group_exit import shutdown_recording_group_exit


@pytest.mark.parametrize("planted", [False, True], ids=["fixed", "planted_leave_with_graphs"])
def test_rank_0_destroys_its_graphs_before_leaving_the_group(planted):
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=64, page_size=4, kv_dtype="fp8",
              graph_rows_without_cuda=True, distributed_timeout_s=60)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.packed is not None, "the check needs graph holders to look at"
    llm.generate(["Count to five."], SamplingParams.greedy(max_tokens=3, ignore_eos=True))
    if planted:  # the shipped order before the fix: the group was left with the runner's graphs alive
        llm.engine._followers.release_graphs = None
    exit_ = shutdown_recording_group_exit(llm.engine)
    assert exit_.left and exit_.finished_in_time
    processes = llm.engine._followers.processes
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    if planted:
        assert exit_.graphs_held == ["graphs", "packed"]
    else:
        assert exit_.graphs_held == []


@pytest.mark.parametrize("planted", [False, True], ids=["fixed", "planted_leave_with_graphs"])
def test_deterministic_rank_0_releases_its_tile_graphs_before_leaving(planted):
    """Deterministic mode keeps its page bucket's holder after the release (its tiles go on through the buffers), so
    the check asks the holder whether its graphs were destroyed."""
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=64, page_size=4, kv_dtype="fp8",
              deterministic=True, distributed_timeout_s=60)
    assert llm.engine.runner.packed is not None and llm.engine.runner.graphs is None
    llm.generate(["Count to five."], SamplingParams.greedy(max_tokens=3, ignore_eos=True))
    if planted:
        llm.engine._followers.release_graphs = None
    exit_ = shutdown_recording_group_exit(llm.engine)
    assert exit_.left and exit_.finished_in_time
    assert exit_.graphs_held == (["packed"] if planted else [])


def test_leaving_releases_first_and_gives_up_on_an_abort_that_hangs(monkeypatch):
    order: list[str] = []
    entered, stuck = threading.Event(), threading.Event()

    def hanging_abort() -> None:
        order.append("abort")
        entered.set()
        stuck.wait(10)

    monkeypatch.setattr(tp_workers, "abort_process_group", hanging_abort)
    monkeypatch.setattr(tp_workers.dist, "is_initialized", lambda: True)
    start = time.monotonic()
    left = tp_workers.leave_group(lambda: order.append("release"), timeout_s=0.2)
    assert entered.wait(5)
    stuck.set()
    assert left is False
    assert time.monotonic() - start < 5
    assert order == ["release", "abort"]


def test_a_failing_release_still_leaves_the_group(monkeypatch):
    aborted = []
    monkeypatch.setattr(tp_workers, "abort_process_group", lambda: aborted.append(True))
    monkeypatch.setattr(tp_workers.dist, "is_initialized", lambda: True)

    def broken_release() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert tp_workers.leave_group(broken_release, timeout_s=5) is True
    assert aborted == [True]


def test_a_follower_destroys_its_graphs_before_it_leaves(monkeypatch):
    """`serve_worker`'s exit, rank 1's side of the fix: its runner's graphs go before its communicators."""
    from prism.engine.config import EngineConfig

    order: list[str] = []

    class Runner:
        def release_cuda_graphs(self) -> None:
            order.append("release")

    class Channel:
        def recv(self):
            return None  # rank 0's stop

    class Rendezvous:
        def reach(self, stage: str) -> None:
            pass

        def reporting(self):
            return contextlib.nullcontext()

    monkeypatch.setattr(tp_workers, "FollowerRendezvous", lambda rank, address, timeout_s: Rendezvous())
    monkeypatch.setattr(tp_workers, "join_group", lambda rank, cfg, rendezvous: (None, Channel()))
    monkeypatch.setattr(tp_workers, "build_rank_runner", lambda model_dir, cfg, group, reach: (Runner(), 0))
    monkeypatch.setattr(tp_workers, "abort_process_group", lambda: order.append("abort"))
    monkeypatch.setattr(tp_workers.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    tp_workers.serve_worker(1, "tcp://127.0.0.1:1", "unused", EngineConfig().to_dict())
    assert order == ["release", "abort"]


def test_leaving_without_a_group_only_releases(monkeypatch):
    monkeypatch.setattr(tp_workers, "abort_process_group", lambda: pytest.fail("no group to abort"))
    monkeypatch.setattr(tp_workers.dist, "is_initialized", lambda: False)
    released = []
    assert tp_workers.leave_group(lambda: released.append(True), timeout_s=1) is True
    assert released == [True]


def test_destroy_graphs_resets_every_graph_whoever_holds_it():
    class Graph:
        def __init__(self):
            self.resets = 0

        def reset(self):
            self.resets += 1

    held = [Graph(), Graph()]
    graphs, outputs = {1: held[0], 2: held[1]}, {1: torch.zeros(1), 2: torch.zeros(1)}
    destroy_graphs(graphs, outputs)
    assert [g.resets for g in held] == [1, 1]  # destroyed, though this test still refers to them
    assert graphs == {} and outputs == {}


def test_runner_release_leaves_no_graph_holder():
    llm = LLM(ensure_tiny_checkpoint(), num_gpu_pages=32, page_size=4, graph_rows_without_cuda=True)
    runner = llm.engine.runner
    assert runner.graphs is not None
    runner.release_cuda_graphs()
    assert (runner.graphs, runner.packed, runner.vision_graphs) == (None, None, None)
