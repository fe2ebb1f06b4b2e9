"""Found by review (session 27): a request's image uuids were bound while its prompt was prepared, before the engine
or the server checked it. A request refused for its length (or its max_tokens, or two of its own parts naming
different pictures with one uuid) named its picture anyway: the uuid then resolved, and another client sending its
own picture under that uuid was refused. Fixed: the names are bound when the engine accepts the prompt
(`InputProcessor.bind_names`)."""

import _common  # noqa: F401

from prism.engine.engine import RequestError  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=16, num_gpu_pages=64, max_model_len=256)
(picture,) = random_images([(32, 32)], seed=3)
content = [{"type": "image", "image": picture, "uuid": "k"}, {"type": "text", "text": "word " * 300}]
try:
    llm.engine.add_request("too-long", [{"role": "user", "content": content}])
    refused = False
except RequestError:
    refused = True
bound = llm.engine.inputs.image_names.resolve("k") is not None
_common.verdict(refused and not bound, "the refused request named nothing",
                f"refused: {refused}; its uuid 'k' names its picture anyway: {bound}")
