"""Found by review (session 27): a request's logprobs carried as many alternatives as the most demanding request of
its step asked for. Three prompts generated together with `logprobs` 2, 0 and 7 each got 7 alternatives per token
(the server's `top_logprobs` the same), so a request's answer depended on its companions. Fixed in
`sampler.token_logprobs`: a row gets its own count (0: the chosen token's logprob alone)."""

import _common  # noqa: F401

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=64)
asked = [2, 0, 7]
outs = llm.generate(["Hi"] * 3, [SamplingParams(max_tokens=2, temperature=0.0, logprobs=k) for k in asked])
got = [[len(entry.top) for entry in out.logprobs] for out in outs]
want = [[k, k] for k in asked]
_common.verdict(got == want, f"alternatives per token {got}, as asked",
                f"alternatives per token {got}, asked {want}: each request got its companions' count")
