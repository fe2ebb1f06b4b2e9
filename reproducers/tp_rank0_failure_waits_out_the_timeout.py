"""Found by review (session 28): under tensor parallelism, a step that failed on rank 0 after its payload went out
stopped the followers with a message none could take (each was inside the lost step's collectives): rank 0 raised
`TensorParallelFailure` only once `distributed_timeout_s` (300 s by default) ran out. Now the followers are
terminated and rank 0 raises at once. Two processes over gloo on the CPU; fails if rank 0 takes a minute."""

from __future__ import annotations

import time

import _common  # noqa: F401 - makes `prism` importable


def main() -> None:
    import torch

    from prism.engine.llm import LLM
    from prism.engine.sampling import SamplingParams
    from prism.engine.tp_workers import TensorParallelFailure
    from prism.testing.checkpoints import ensure_tiny_checkpoint
    from prism.testing.tp_faults import lose_steps_after_their_payload

    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=32, page_size=4,
              max_num_batched_tokens=160, distributed_timeout_s=120)
    lose_steps_after_their_payload(llm.engine.runner)
    start = time.perf_counter()
    try:
        llm.generate(["Hello there"], SamplingParams.greedy(max_tokens=4, ignore_eos=True))
        raised = None
    except TensorParallelFailure as error:
        raised = error
    took = time.perf_counter() - start
    llm.engine.shutdown()
    _common.verdict(raised is not None and took < 60, f"rank 0 raised TensorParallelFailure in {took:.1f} s",
                    f"rank 0 took {took:.0f} s to fail the lost step ({raised!r})")


if __name__ == "__main__":
    main()
