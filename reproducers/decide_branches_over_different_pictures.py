"""Found by review (session 27): `Engine.add_decision` took the branches' common token ids as their shared material.
An image's pad tokens are the same for any picture of its size, so two branches over different pictures of one size
shared the first branch's image KV, and the second was answered about the wrong picture. Fixed: branches whose
images differ under equal token ids are refused (a RequestError), not merged."""

import _common  # noqa: F401

from prism.decision.questions import Question, candidate_token_ids  # noqa: E402
from prism.engine.engine import RequestError  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.request import Branch  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", num_gpu_pages=128)
inputs = llm.engine.inputs
question = Question("yes_no", "Is it red?")
pictures = random_images([(64, 64), (64, 64)], seed=5)
branches = [Branch(f"pic{k}", inputs.prepare_chat([
    {"role": "user", "content": [{"type": "image", "image": pictures[k]}, {"type": "text", "text": "Look."}]},
    {"role": "user", "content": question.render()}]), candidate_token_ids(question, inputs.encode)) for k in (0, 1)]
try:
    llm.engine.add_decision("two-pictures", branches)
    refused = False
except RequestError:
    refused = True
_common.verdict(refused, "branches over two different pictures are refused as one material",
                "branches over two different pictures were merged into one material: the second reads the first's image")
