"""Found by review (session 27): `Engine.add_decision` took the branches' common token ids as their shared material.
An image's pad tokens are the same for any picture of its size, so two branches over different pictures of one size
shared the first branch's image KV, and the second was answered about the wrong picture. Fixed (session 28, after a
first fix that refused such branches): the material ends before the first image the branches do not all hold, so
each question is read over its own picture, as it is when asked alone."""

import _common  # noqa: F401

from prism.decision.questions import Question, candidate_token_ids  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.request import Branch  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402


def new_llm() -> LLM:
    # Deterministic mode: a branch read over the shared material equals it read alone bit for bit (in the default mode
    # the material's prefill and a whole prompt's round differently before FP8 quantization: up to ~5e-4 here, which
    # with the installed Pillow's pixels crossed the 1e-4 this script once allowed).
    return LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=128, deterministic=True)


def readouts(llm: LLM) -> dict[str, list[float]]:
    out = {}
    while llm.engine.has_unfinished_requests():
        for event in llm.engine.step():
            if event.finished and event.readout is not None:
                out[event.request_id] = event.readout
    return out


question = Question("yes_no", "Is it red?")
pictures = random_images([(64, 64), (64, 64)], seed=5)
llm = new_llm()
inputs = llm.engine.inputs
branches = [Branch(f"pic{k}", inputs.prepare_chat([
    {"role": "user", "content": [{"type": "image", "image": pictures[k]}, {"type": "text", "text": "Look."}]},
    {"role": "user", "content": question.render()}]), candidate_token_ids(question, inputs.encode)) for k in (0, 1)]
llm.engine.add_decision("two-pictures", branches)
together = readouts(llm)
apart = {}
for b in branches:
    fresh = new_llm()
    fresh.engine.add_readout_request(b.request_id, b.prompt, b.candidates)
    apart.update(readouts(fresh))
wrong = [k for k in apart if together[k] != apart[k]]
_common.verdict(not wrong, "branches over two different pictures of one size are each read over their own picture",
                f"branches over two different pictures read other than alone ({wrong}): one read the other's image "
                f"(together {together}, alone {apart})")
