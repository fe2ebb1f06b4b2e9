"""Found in session 14's final read: a continuation carrying a one-token prefill chunk (interleaving at 1 token, or a
prompt's last token alone) was a step of one-token pieces only, which the runner's graph choice gives to the row
graphs, while the continuation insisted on the packed ones: it raised, and the step's decodes and the prompt
failed with it. The chunk step is now built as the scheduler's steps are (rows or packed, device ids in the first
rows). Runs a decode with a late prompt interleaved 1 token at a time, async against synchronous."""

import _common  # noqa: F401

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint


def run(async_scheduling: bool) -> tuple[dict, dict, int]:
    eng = LLM(ensure_tiny_checkpoint(), page_size=4, num_gpu_pages=160, interleave_prefill_tokens=1,
              graph_rows_without_cuda=True, cuda_graph_max_packed_tokens=128, async_scheduling=async_scheduling,
              check_invariants=True).engine
    eng.add_request("decoder", "Count to twenty.", SamplingParams.greedy(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.add_request("late", "A short late prompt.", SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    tokens, reasons = {}, {}
    while eng.has_unfinished_requests():
        for event in eng.step():
            tokens.setdefault(event.request_id, []).extend(event.new_token_ids)
            if event.finished:
                reasons[event.request_id] = event.finish_reason.value
    return tokens, reasons, eng.stats.async_chunk_steps


want, _, _ = run(False)
got, reasons, chunk_steps = run(True)
_common.verdict(
    got == want and set(reasons.values()) == {"length"} and chunk_steps > 0,
    f"{chunk_steps} one-token chunks launched beside the decode rows; the tokens are the synchronous engine's",
    f"finish reasons {reasons}, {chunk_steps} chunk steps ahead; tokens equal: {got == want}",
)
