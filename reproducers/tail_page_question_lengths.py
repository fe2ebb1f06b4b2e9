"""Historical: the same image + a second question whose boundary with the first lies inside a page.
Shorter second question -> "partial KV block has a prefix hash"; longer -> question 1's hash mapped to
question 2's content. Fixed when the second request gets a private tail page holding only the common
rows, without a key, and every findable page still holds its own content's KV, for both lengths."""

import _common  # noqa: F401

from prism.kv.content import MediaSpan, SeqContent
from prism.testing.kv_world import KVWorld

IMAGE = MediaSpan(1, 6, b"\x11" * 16)
PREFIX = [100] + [9] * 6 + [101]  # text, image placeholders, text: 8 tokens = 2 pages of 4
problems = []
for label, question2 in (("shorter", [7]), ("longer", [7, 8, 8, 8, 8, 8, 8])):
    world = KVWorld(num_gpu_pages=16, page_size=4)
    q1 = SeqContent(PREFIX + [5, 6, 6, 6, 6], (IMAGE,))  # 13 tokens, boundary with q2 inside page 2
    world.admit(1, q1, chunk=len(q1))
    world.step()
    world.release(1)
    q2 = SeqContent(PREFIX + [5] + question2, (IMAGE,))
    hit = world.admit(2, q2, chunk=len(q2))
    plan = world.step()
    world.check_all()
    seq = world.manager.seqs[2]
    tail_page = seq.pages[hit // 4][1]
    record = world.manager.index.record(tail_page)
    if hit != 9 or len(plan.copy_prefix) != 1 or plan.copy_prefix[0][2] != 1:
        problems.append(f"{label}: expected a 9-token hit with a 1-row tail copy, got {hit} and {plan.copy_prefix}")
    if record is not None and record.key is not None and len(q2) < 12:
        problems.append(f"{label}: the partly filled tail page has a key")
    world.release(2)
    world.check_all()
_common.verdict(not problems, "both question lengths get a keyless private tail of the common rows", "; ".join(problems))
