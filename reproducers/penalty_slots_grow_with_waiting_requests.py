"""Found by review: a penalized request kept its slot of the penalty count table (an int32 row of the vocabulary,
608 KB at Qwen3-VL's) while it was preempted, swapped out or dropped to recompute, until it finished; the table
doubled whenever its slots ran out, at run time, after the KV pool had taken the device's memory. The slots held
were bounded by the live requests that had once sampled, not by `max_num_seqs`: a preempted request waits beside
requests that run (here an older request waiting for a shared prefill to be computed is admitted after a younger one
ran ahead of it, and the younger one, preempted, waits holding its slot). Fixed: every transition out of RUNNING
gives the slot back (`Request.transition`), a resumed request's next penalized sample refills a fresh slot from its
whole history, and the table has exactly `max_num_seqs` slots, allocated once (`engine/penalty_counts.py`).

The tiny checkpoint, `max_num_seqs=2`, a pool too small for two of the long requests: after every step at most two
requests may hold a slot, and every request's greedy penalized tokens must be those of a pool that preempts nobody."""

import _common
import torch  # noqa: E402

from prism.engine.config import EngineConfig  # noqa: E402
from prism.engine.engine import Engine  # noqa: E402
from prism.engine.request import FinishReason  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

MAX_NUM_SEQS = 2
SHARED = ("The quick brown fox jumps over the lazy dog while the sea rolls on and on under a grey sky, far away, and "
          "the gulls cry out over the waves.\n")


def serve(num_gpu_pages: int) -> tuple[Engine, dict[str, list[int]], int]:
    """(the engine, each request's tokens, the most requests holding a slot after a step)."""
    engine = Engine(ensure_tiny_checkpoint(), EngineConfig(
        page_size=4, num_gpu_pages=num_gpu_pages, max_model_len=96, max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=32, kv_dtype="fp32", async_scheduling=False, defer_shared_prefill_tokens=8))
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True, presence_penalty=1.5)
    engine.add_request("first", SHARED + "Go on.", params)
    tokens: dict[str, list[int]] = {"first": []}
    peak = 0
    for step in range(1000):
        if step == 1:  # while "first" computes the shared prefix, "shared" waits for it and "other" runs ahead
            engine.add_request("shared", SHARED + "And then?", params.with_(max_tokens=8))
            engine.add_request("other", "Hi.", params)
            tokens.update(shared=[], other=[])
        for event in engine.step():
            tokens[event.request_id].extend(event.new_token_ids)
            if event.finished and event.finish_reason is not FinishReason.LENGTH:
                raise AssertionError(f"{event.request_id} ended {event.finish_reason}: {event.error}")
        peak = max(peak, sum(1 for r in engine.requests.values()
                             if r._penalty_counts is not None and r._penalty_counts.table is not None))
        if step >= 1 and not engine.has_unfinished_requests():
            return engine, tokens, peak
    raise AssertionError("the requests did not finish in 1000 steps")


torch.set_num_threads(1)
small, got, peak = serve(24)
_, want, _ = serve(256)
table = getattr(small, "penalty_counts", None)
size = f", a table of {table.nbytes:,} bytes allocated once" if table is not None else ""
_common.verdict(
    peak <= MAX_NUM_SEQS and got == want and small.stats.preemptions > 0,
    f"after {small.stats.preemptions} preemptions at most {peak} requests held a slot (max_num_seqs="
    f"{MAX_NUM_SEQS}){size}, and every request's penalized tokens are those of a pool that preempts nobody",
    f"{peak} requests held a slot of the penalty count table at once with max_num_seqs={MAX_NUM_SEQS} (preempted "
    f"requests keep theirs while they wait; {small.stats.preemptions} preemptions), or the tokens changed "
    f"({got != want})",
)
