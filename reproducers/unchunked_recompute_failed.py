"""Found by review (session 27): with chunked prefill off, a request preempted by recompute had to compute its
prompt and every token it had generated in one step. A 24-token prompt preempted after 25 tokens, on a 40-token
step, ended with ERROR "the prompt needs 44 tokens in one step ... chunked prefill is off". Fixed in
`Scheduler.chunk_end`: only the prompt must go in one step; the recomputed output may follow in more."""

import _common  # noqa: F401

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=4, num_gpu_pages=24, max_model_len=80,
          enable_chunked_prefill=False, max_num_batched_tokens=40, async_scheduling=False)
outs = llm.generate([f"Request {i}: tell me about the number {i * 7}." for i in range(2)],
                    [SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)] * 2)
got = [(o.finish_reason.value, len(o.token_ids), o.error) for o in outs]
_common.verdict(all(reason == "length" and n == 50 for reason, n, _ in got),
                f"both requests finished despite preemption: {got}", f"a preempted request failed: {got}")
