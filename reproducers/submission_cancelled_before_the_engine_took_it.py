"""Found by review (session 22): a handler cancelled while its request waited for the engine thread to take it
(between steps) left the queued add behind: the request was added afterwards and ran to its end for nobody, its
slot held (a decide's thinking generation: 4,096 tokens, 64 s). Fixed when the cancellation queues an abort of
every request of the submission behind the add (`AsyncEngine._submit`)."""

import asyncio
import time

import _common  # noqa: F401

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.serving.async_engine import AsyncEngine  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), kv_dtype="fp32", page_size=16, num_gpu_pages=2048)
front = AsyncEngine(llm.engine, max_in_flight=4)
prompt = llm.engine.inputs.prepare_prompt("Talk.")


async def main() -> None:
    submit = asyncio.ensure_future(
        front.start_generation("late", prompt, SamplingParams(max_tokens=30000, ignore_eos=True)))
    await asyncio.sleep(0.05)  # queued; the engine thread is not running yet
    submit.cancel()
    await asyncio.gather(submit, return_exceptions=True)
    front.start()
    deadline = time.time() + 3
    while llm.engine.requests and time.time() < deadline:
        await asyncio.sleep(0.05)


asyncio.run(main())
left, slots = list(llm.engine.requests), front._slots_taken
front.shutdown()
_common.verdict(not left and slots == 0, "the cancelled submission was aborted once the engine took it",
                f"3 s after its handler was cancelled, {left} ran on ({slots} slot(s) held)")
