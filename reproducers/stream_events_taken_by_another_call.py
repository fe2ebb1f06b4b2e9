"""Found by review (session 27): `LLM.stream` and `LLM.generate` each stepped the shared engine and kept only their
own requests' events. A `generate` run while a stream was open took the stream's remaining events; the stream then
stepped an empty engine for ever (100% CPU). Fixed in `engine/llm.py`: every request an `LLM` call makes has a
mailbox, and each step's events go to their requests' mailboxes."""

import signal

import _common  # noqa: F401

from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402


def hung(signum, frame):
    _common.verdict(False, "", "the stream was still waiting after 60 s: its events were taken by the generate")


llm = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=64)
greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
(alone,) = llm.generate(["Tell me a story."], greedy)
stream = llm.stream("Tell me a story.", greedy)
tokens = list(next(stream).new_token_ids)
llm.generate(["Hi"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))  # steps the stream's request
signal.signal(signal.SIGALRM, hung)
signal.alarm(60)
for event in stream:
    tokens += event.new_token_ids
signal.alarm(0)
_common.verdict(tokens == alone.token_ids, f"the stream read all of its tokens {tokens} beside the generate",
                f"the stream read {tokens}, alone {alone.token_ids}: events lost to the generate")
