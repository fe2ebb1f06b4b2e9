"""Spec of transfer order (REFERENCE §2, invariant 5) and payload/scales moving together (invariant 4).

A tiny, nearly full pool (4-6 GPU pages, 2-3 CPU pages) is prepared with computed sequences; then ONE
plan is built by the real manager from a random mix of swap-outs, swap-ins, new questions over cached
prompts (copy-prefix) and forks that write (copy-on-write), so freed pages get reused inside the plan.
Executing that plan with the real executor on the real FP8 pools (payload and scales) must equal its
snapshot meaning, and afterwards every live sequence must still read its own KV.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from prism.kv.content import SeqContent
from prism.kv.pages import OutOfPages
from prism.kv.transfers import Move, PlanConflict, TransferPlan, check_snapshot_semantics
from prism.testing.kv_world import KVWorld

PAGE = 2
OPS = st.lists(
    st.tuples(st.sampled_from(["swap_out", "swap_in", "question", "fork_write", "release"]), st.integers(0, 7)),
    min_size=1,
    max_size=8,
)


def prepared_world(num_gpu: int, num_cpu: int, prompts: list[list[int]], preswap: list[bool]) -> KVWorld:
    """Computed sequences; those marked in `preswap` are already swapped out (in an earlier plan)."""
    world = KVWorld(num_gpu_pages=num_gpu, page_size=PAGE, num_cpu_pages=num_cpu)
    for seq_id, tokens in enumerate(prompts):
        try:
            world.admit(seq_id, SeqContent(list(tokens)), len(tokens))
        except OutOfPages:
            continue
        world.step()
    for seq_id, swap in zip(sorted(world.manager.seqs), preswap, strict=False):
        if swap:
            try:
                world.manager.swap_out(seq_id)
            except OutOfPages:
                pass
    world.step()
    return world


def build_one_plan(world: KVWorld, ops: list[tuple[str, int]]) -> None:
    m = world.manager
    next_id = 100
    for kind, pick in ops:
        ids = sorted(m.seqs)
        if not ids:
            return
        seq_id = ids[pick % len(ids)]
        seq = m.seqs[seq_id]
        child_id, next_id = next_id, next_id + 1
        try:
            if kind == "swap_out" and seq_id not in world.pending:  # the scheduler never swaps a seq it is computing
                m.swap_out(seq_id)
            elif kind == "swap_in":
                m.swap_in(seq_id)
            elif kind == "question" and seq.is_resident:
                tokens = seq.content.tokens[: max(1, len(seq.content) - 1)] + [3]
                world.admit(child_id, SeqContent(tokens), len(tokens))
            elif kind == "fork_write" and seq.is_resident and seq.num_computed == len(seq.content):
                m.fork(seq_id, child_id)
                world.decode(child_id, 2)
            elif kind == "release" and seq_id not in world.pending:
                world.release(seq_id, keep_in_cache=True)
        except (OutOfPages, PlanConflict):
            continue


def classify(plan: TransferPlan) -> None:
    freed_by_swap_out = {g for g, _ in plan.swap_out}
    reused = {d for _, d, _ in plan.copy_prefix} | {d for _, d in plan.copy_on_write}
    if freed_by_swap_out & reused:
        event("a swapped-out GPU page is reused as a copy target in the same plan")
    if plan.swap_in and plan.swap_out:
        event("swap-in and swap-out in one plan")


@settings(max_examples=300, deadline=None)
@given(
    num_gpu=st.integers(4, 6),
    num_cpu=st.integers(2, 3),
    prompts=st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=5), min_size=1, max_size=4),
    preswap=st.lists(st.booleans(), max_size=4),
    ops=OPS,
)
def spec_one_plan_has_snapshot_semantics(num_gpu: int, num_cpu: int, prompts, preswap, ops) -> None:
    world = prepared_world(num_gpu, num_cpu, prompts, preswap)
    build_one_plan(world, ops)
    classify(world.manager.plan)
    world.step()  # raises if executing differs from the snapshot meaning
    world.check_all()
    for seq_id in list(world.manager.seqs):
        if not world.manager.seqs[seq_id].is_resident:
            try:
                world.manager.swap_in(seq_id)
            except OutOfPages:
                world.release(seq_id)
    world.step()
    world.check_all()


MOVES = st.lists(
    st.tuples(st.sampled_from(["swap_in", "swap_out", "copy_prefix", "copy_on_write"]), st.integers(0, 3),
              st.integers(0, 3)),
    max_size=12,
)


def _move(kind: str, src: int, dst: int) -> Move:
    if kind == "swap_in":
        return Move(kind, ("cpu", src), ("gpu", dst))
    if kind == "swap_out":
        return Move(kind, ("gpu", src), ("cpu", dst))
    return Move(kind, ("gpu", src), ("gpu", dst), 1 if kind == "copy_prefix" else None)


@settings(max_examples=400, deadline=None)
@given(moves=MOVES)
def spec_adding_a_move_checks_what_the_whole_plan_check_says(moves) -> None:
    """`TransferPlan.add` keeps what it checks as moves are added (O(1) a move; rechecking the whole plan per move
    was quadratic: 3.7 s for one 2,048-page swap). It must refuse exactly the moves `check_snapshot_semantics`
    refuses beside the plan's moves, whatever kinds come in whatever order over a few slots."""
    plan = TransferPlan()
    accepted: list[Move] = []
    for kind, src, dst in moves:
        move = _move(kind, src, dst)
        try:
            check_snapshot_semantics(plan.moves() + [move])
            allowed = True
        except PlanConflict:
            allowed = False
        try:
            plan.add(move)
            added = True
        except PlanConflict:
            added = False
        event("refused" if not allowed else "accepted")
        assert added == allowed, f"add {'accepted' if added else 'refused'} {move} after {accepted}; the whole " \
                                 f"plan check {'accepts' if allowed else 'refuses'} it"
        accepted += [move] if added else []
    assert sorted(plan.moves(), key=repr) == sorted(accepted, key=repr)
