"""Historical: one plan swapped a page out and reused the freed GPU slot as a copy-on-write target; the
executor ran the copy first and swapped out the overwritten page. 4 GPU pages, 2 CPU pages. Fixed when
the executor runs swap-in -> swap-out -> copy-prefix -> CoW so the plan equals its snapshot meaning and
both sequences read back their own KV."""

import _common  # noqa: F401

from prism.kv.content import SeqContent
from prism.testing.kv_world import KVWorld

world = KVWorld(num_gpu_pages=4, page_size=2, num_cpu_pages=2)
world.admit(1, SeqContent([1, 2, 3, 4]), chunk=4)  # pages 0, 1
world.admit(2, SeqContent([5, 6, 7]), chunk=3)  # pages 2, 3 (page 3 half full)
world.step()
world.manager.fork(2, 3)  # sequence 3 shares sequence 2's pages
world.manager.swap_out(1)  # frees GPU pages 0 and 1 inside this plan
world.decode(3, 8)  # sequence 3 writes into the shared half page: copy-on-write into a freed slot
plan = world.manager.plan
reused = {g for g, _ in plan.swap_out} & {d for _, d in plan.copy_on_write}
try:
    world.step()  # compares execution with the plan's snapshot meaning
    world.check_all()  # sequence 3 reads its copied page
    world.release(3)
    world.manager.swap_in(1)
    world.step()
    world.check_all()
    ok, detail = True, ""
except AssertionError as error:
    ok, detail = False, str(error)
_common.verdict(
    ok and bool(reused),
    f"GPU page {sorted(reused)} was swapped out and reused by CoW in one plan; every sequence kept its KV",
    detail or "the scenario did not reuse a swapped-out slot (reproducer no longer reaches the bug)",
)
