"""Both ranks of a TP2 engine with CUDA graphs hung forever at shutdown on two H200s (NCCL 2.28, torch 2.11):
`destroy_process_group`, then the abort that replaced it, waited on communicators that the captured decode graphs
(holding all-reduces) still referenced. A rank must destroy its graphs before it leaves its group. Checked on the
CPU (two gloo ranks, the graph holders of `graph_rows_without_cuda`): none may be alive when rank 0 leaves."""

import _common
import torch  # noqa: E402

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.group_exit import shutdown_recording_group_exit  # noqa: E402


def main() -> None:  # the follower rank is spawned: it re-imports this file, so nothing runs at import
    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=64, page_size=4, kv_dtype="fp8",
              graph_rows_without_cuda=True, distributed_timeout_s=60)
    llm.generate(["Count to five."], SamplingParams.greedy(max_tokens=3, ignore_eos=True))
    exit_ = shutdown_recording_group_exit(llm.engine)
    _common.verdict(
        exit_.left and not exit_.graphs_held,
        "rank 0 destroys its graphs before it aborts its communicators",
        f"rank 0 left its group with graph holders alive: {exit_.graphs_held} (left: {exit_.left}); with CUDA graphs "
        "that captured NCCL collectives, NCCL's teardown waits for them forever",
    )


if __name__ == "__main__":
    main()
