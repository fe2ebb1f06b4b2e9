"""Found in review (session 25): deterministic mode replays one CUDA graph per page-sized tile, several tiles per step,
and concatenates the sampling tiles' logits after the last. `PackedGraphs.run` returned `logits.float()`, which for
fp32 weights is a view of the graph's static output buffer: the next tile's replay overwrote it, so every sequence of
a step read the last tile's logits (a decide's branches all got the same answer). On the CPU nothing is captured, so
this stands a graph in for the page bucket whose replay writes the eager forward into a static output buffer, as a
CUDA graph does, and runs two prompts together against each alone (fp32 weights)."""

import _common  # noqa: F401
import torch

from prism.engine.llm import LLM
from prism.engine.sampling import SamplingParams
from prism.testing.checkpoints import ensure_tiny_checkpoint
from prism.testing.static_output_graph import stand_in_static_output_graph

PROMPTS = ("Tell me about paged attention please.", "Why is the sky blue? Answer briefly.")


def logits(prompts) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), dtype="float32", kv_dtype="fp8", page_size=8, num_gpu_pages=256,
              deterministic=True, check_invariants=True)
    runner = llm.engine.runner
    holder = runner.packed
    stand_in_static_output_graph(holder, holder.buckets[0], rows=holder.max_seqs + 1)
    got: dict[str, list[torch.Tensor]] = {}
    execute = runner.execute

    def capture(slices, kv, *rest):
        out = execute(slices, kv, *rest)
        for row, s in enumerate([s for s in slices if s.sample]):
            got.setdefault(s.request.request_id, []).append(out[row].clone())
        return out

    runner.execute = capture
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{i}", prompt, SamplingParams.greedy(max_tokens=3, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert holder.replays > 0
    return [torch.stack(got[f"r{i}"]) for i in range(len(prompts))]


alone = [logits([p])[0] for p in PROMPTS]
together = logits(PROMPTS)
same = [torch.equal(a, t) for a, t in zip(alone, together, strict=True)]
_common.verdict(
    all(same),
    "two prompts in one deterministic step each read their own tile's logits, bitwise as alone",
    f"logits equal to each prompt alone: {same} (the first reads the last tile's: "
    f"{torch.equal(together[0], alone[1])})",
)
