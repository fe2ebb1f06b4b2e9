"""Historical: two idle cache entries sharing the same pages; reclaimable space was counted as pages with
refcount == 1, so a request that evicting both entries could serve was refused. Fixed when can_allocate
counts unique pages held only by entries, and the request is admitted by really evicting them."""

import _common  # noqa: F401

from prism.kv.content import SeqContent
from prism.testing.kv_world import KVWorld

world = KVWorld(num_gpu_pages=6, page_size=4)
shared = [1, 2, 3, 4, 5, 6, 7, 8]
for seq_id, question in ((1, [20, 21, 22, 23]), (2, [30, 31, 32, 33])):
    world.admit(seq_id, SeqContent(shared + question), chunk=12)
    world.step()
    world.release(seq_id)  # both entries now hold the two shared pages; each also holds its own page
world.check_all()
promised = world.manager.num_allocatable()
try:
    world.admit(3, SeqContent(list(range(40, 64))), chunk=24)  # 24 new tokens = 6 pages: all of the pool
    world.step()
    world.check_all()
    admitted = True
except Exception as error:  # noqa: BLE001
    admitted, reason = False, error
_common.verdict(
    promised == 6 and admitted,
    "2 free pages + 4 unique entry pages (2 of them held by both entries) = 6; the 6-page request was admitted",
    f"can_allocate promised {promised} of 6 reclaimable pages"
    + ("" if admitted else f"; the request was refused: {reason}"),
)
