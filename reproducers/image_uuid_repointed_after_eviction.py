"""Found while building image uuids (vLLM's `uuid` on image parts): the first version kept a uuid's name in the
preprocessing cache beside the pixels, so when the cache evicted it, a later request sending ANOTHER image under
the same uuid re-pointed the name, and the first client, naming its uuid alone, got someone else's image.
Fixed when names are bound to the image's cache key in their own table (engine/image_names.py), which the pixel
cache's evictions do not touch."""

import _common

from prism.engine.inputs import InputError, InputProcessor  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

mine, theirs = random_images([(32, 32), (64, 64)], seed=9)


def chat(part):
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]


probe = InputProcessor(ensure_tiny_checkpoint(), model_id="repro")
one_image = probe.prepare_chat(chat({"type": "image", "image": theirs})).media[0].pixels.nbytes
proc = InputProcessor(ensure_tiny_checkpoint(), model_id="repro", cache_bytes=one_image + 1)  # room for one image
proc.prepare_chat(chat({"type": "image", "image": mine, "uuid": "shelf"}))
try:
    proc.prepare_chat(chat({"type": "image", "image": theirs, "uuid": "shelf"}))  # evicts mine's pixels
except InputError as error:
    _common.verdict("already names a different image" in str(error),
                    "a uuid keeps naming the image it was first sent with, after the pixel cache evicted it",
                    f"another image under the same uuid was refused for another reason: {error}")
_common.verdict(False, "", "another image sent under the uuid 'shelf' after an eviction re-pointed the name: "
                "the first client, naming 'shelf' alone, would get someone else's image")
