"""Found in review (session 21, TP2 with `tensor_parallel_async_scheduling`): rank 0 lost a step launched on tokens it
had not read after its payload had gone to the follower. Rank 0 failed that step's requests and went on, as one
rank does, while the follower sat in the lost step's collectives: rank 0's next step met the follower in the wrong
collective and failed only when it timed out ("Connection closed by peer" over gloo; on NCCL, whose collectives
carry no tags, mismatched pairs). Fixed when such a failure stops every rank with `TensorParallelFailure` at once,
as a scheduled step's failure under TP always did (`lost_steps.stop_every_rank`).

Two ranks over gloo on the CPU (the engine spawns rank 1), the tiny checkpoint, the graphs' rows run eagerly; rank
0's graph step raises for rows fed device tokens, i.e. after the payload was published."""

import _common  # noqa: F401


def main() -> None:
    import torch

    from prism.engine.llm import LLM
    from prism.engine.sampling import SamplingParams
    from prism.engine.tp_workers import TensorParallelFailure
    from prism.testing.checkpoints import ensure_tiny_checkpoint
    from prism.testing.tp_faults import LOST_STEP, lose_device_token_steps

    torch.set_num_threads(1)
    llm = LLM(ensure_tiny_checkpoint(), tensor_parallel_size=2, num_gpu_pages=32, kv_dtype="fp8", page_size=4,
              graph_rows_without_cuda=True, tensor_parallel_async_scheduling=True, distributed_timeout_s=10)
    lose_device_token_steps(llm.engine.runner)
    outcome = "generate returned"
    try:
        out = llm.generate(["Hello there", "Hi again"], SamplingParams.greedy(max_tokens=6, ignore_eos=True))
        outcome += f" with finish reasons {[c.finish_reason for c in out]}"
        ok = False
    except TensorParallelFailure as error:
        ok = LOST_STEP in str(error) and llm.engine._followers.closed
        outcome = f"TensorParallelFailure: {error}"
    except Exception as error:  # noqa: BLE001 - what the bug looked like: a later step's collective failing
        ok, outcome = False, f"{type(error).__name__}: {error}"
    finally:
        llm.engine.shutdown()
    _common.verdict(ok, f"the lost step stopped every rank at once ({outcome[:160]})",
                    f"the lost step did not stop every rank with its own error: {outcome[:300]}")


if __name__ == "__main__":
    main()
