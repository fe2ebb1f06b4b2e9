"""Async scheduling's hazard case: a request stops on a token the host reads only after the next decode step
was launched with a row for it. That row must be dropped: the request ends on its stop token (no token after
it, one terminal event), its pages are released (nothing leaks), and the request decoding beside it gets the
tokens it gets with async scheduling off. Tiny checkpoint, CPU, the CUDA graphs' rows run eagerly."""

import _common

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402


def run(async_scheduling: bool, stop_tokens: tuple[int, ...] = ()):
    llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp8", page_size=16, num_gpu_pages=64,
              graph_rows_without_cuda=True, async_scheduling=async_scheduling, check_invariants=True)
    prompts = ["Tell me a story about a cat.", "Name three colours, please."]
    params = [SamplingParams.greedy(max_tokens=12, stop_token_ids=stop_tokens),
              SamplingParams.greedy(max_tokens=12, ignore_eos=True)]
    out = llm.generate(prompts, params)
    kv = llm.engine.kv
    leaked = {p for p in range(kv.gpu.num_pages) if kv.gpu.refcount[p]} - set(kv.entries.entry_refs)
    return out, llm.engine.stats.async_steps, leaked


reference, _, _ = run(False)
stop = reference[0].token_ids[3]  # the first request's 4th greedy token becomes its stop token
want = reference[0].token_ids[: reference[0].token_ids.index(stop) + 1]
expected, _, _ = run(False, (stop,))
got, launched_ahead, leaked = run(True, (stop,))
ok = (got[0].token_ids == want and got[0].finish_reason.value == "stop" and not leaked
      and got[1].token_ids == expected[1].token_ids and launched_ahead > 0)
_common.verdict(ok, f"the stopped request ends on its stop token {want}, {launched_ahead} steps launched ahead, "
                    "nothing leaked, the other request's tokens unchanged",
                f"tokens {got[0].token_ids} (want {want}, {got[0].finish_reason}), leaked pages {sorted(leaked)}, "
                f"other {got[1].token_ids} vs {expected[1].token_ids}, {launched_ahead} steps launched ahead")
