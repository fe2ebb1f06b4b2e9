"""Historical (TP2): each rank sized its KV pool from its own memory budget. Rank 0's KV manager hands out
page ids for its own pool, so a rank with fewer pages got ids past its pool (divergent KV, or a crash in
one rank while the other waited in a collective forever), and a rank with no room at all left the other
hanging. Fixed when the real rank set-up (`prism.engine.rank.build_rank_runner`) agrees on the MIN page
count over ranks before allocating, and a rank with no page makes every rank raise the same error.

Two ranks run the real set-up on the tiny checkpoint as threads whose collectives really exchange values
(`prism.testing.thread_ranks`); a rank left waiting times out instead of hanging this script."""

import _common  # noqa: F401

from prism.distributed.capacity import KVCapacityError  # noqa: E402
from prism.engine.config import EngineConfig  # noqa: E402
from prism.engine.rank import build_rank_runner  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.thread_ranks import ThreadWorld  # noqa: E402

CKPT = ensure_tiny_checkpoint()
BASE = EngineConfig(page_size=4, tensor_parallel_size=2, device="cpu", dtype="float32")


def set_up(budgets):
    def rank_set_up(rank):
        runner, _ = build_rank_runner(CKPT, BASE.replace(kv_memory_bytes=budgets[rank.rank]), rank)
        return runner.gpu_pool.layout.num_pages

    return ThreadWorld(2, timeout_s=20.0).run(rank_set_up)


problems = []
different = set_up((1 << 20, 1 << 19))  # rank 1 has half the KV memory of rank 0
if any(kind != "ok" for kind, _ in different):
    problems.append(f"different budgets: a rank failed: {different}")
elif different[0][1] != different[1][1]:
    problems.append(f"different budgets: ranks allocated {[v for _, v in different]} pages (must agree on the MIN)")
no_room = set_up((1 << 20, 1))  # rank 1 holds no page
errors = [v for _, v in no_room]
if not all(kind == "error" and isinstance(e, KVCapacityError) for (kind, _), e in zip(no_room, errors, strict=True)):
    problems.append(f"a rank with no page: ranks ended with {no_room} (every rank must raise KVCapacityError)")
elif len({str(e) for e in errors}) != 1:
    problems.append(f"a rank with no page: ranks raised different errors: {errors}")
_common.verdict(
    not problems,
    f"both ranks allocated {different[0][1]} pages with different budgets; with no room both raised: {errors[0]}",
    "; ".join(problems),
)
