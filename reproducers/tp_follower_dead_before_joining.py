"""Found by review of the tensor-parallel start-up: a follower rank that died before it reached the rendezvous
(killed, or failing before it joined the group) kept rank 0 waiting for it all of `distributed_timeout_s` (300 s
by default), then failing with "waiting for clients. 1/2 clients joined", which names no rank; and since torch had
counted the group rank 0 never formed, no TP engine could start in that process again. Now rank 0 watches the
followers while it waits and fails at once, naming the rank and its exit code, with every follower stopped; a TP
engine starts after it. Two processes over gloo on the CPU (rank 1 kills itself); fails if rank 0 takes 15 s."""

from __future__ import annotations

import time

import _common  # noqa: F401 - makes `prism` importable

TIMEOUT_S = 30


def main() -> None:
    import torch

    from prism.engine.llm import LLM
    from prism.engine.sampling import SamplingParams
    from prism.engine.tp_workers import TensorParallelFailure
    from prism.testing.checkpoints import ensure_tiny_checkpoint
    from prism.testing.tp_faults import dying_follower, live_followers

    torch.set_num_threads(1)
    config = dict(tensor_parallel_size=2, device="cpu", num_gpu_pages=32, page_size=4, max_num_batched_tokens=160,
                  distributed_timeout_s=TIMEOUT_S)
    start = time.perf_counter()
    raised = None
    try:
        with dying_follower("killed_before_joining"):
            LLM(ensure_tiny_checkpoint(), **config).engine.shutdown()
    except TensorParallelFailure as error:
        raised = error
    took = time.perf_counter() - start
    named = raised is not None and "rank 1 exited with code -9" in str(raised)
    if not (named and took < 15):
        _common.verdict(False, "", f"rank 0 took {took:.0f} s (distributed_timeout_s={TIMEOUT_S}) to fail with "
                                   f"{raised!r}, not naming rank 1's exit at once")
    left = live_followers()
    llm = LLM(ensure_tiny_checkpoint(), **config)  # the failed start left nothing behind in this process
    try:
        (out,) = llm.generate(["Hello there"], SamplingParams.greedy(max_tokens=2, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    _common.verdict(not left and len(out.token_ids) == 2,
                    f"rank 0 failed in {took:.1f} s ({raised}); a TP engine started after it",
                    f"followers of the failed start still running: {left}")


if __name__ == "__main__":
    main()
