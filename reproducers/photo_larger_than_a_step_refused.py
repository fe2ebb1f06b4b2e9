"""Found by review (session 27): an image that smart resize made larger than one step's tokens was refused ("too
large for this server", a 400) instead of downscaled: every 12 MP phone photo on the 8B config (8,192 tokens a
step), every image over ~2 MP at the default 2,048. Fixed: the engine's image settings carry its step budget
(`ImageProcessorConfig.within_tokens`) and such an image is resized again to fit (`media.image.target_size`)."""

import _common  # noqa: F401

from prism.engine.engine import RequestError  # noqa: E402
from prism.engine.llm import LLM  # noqa: E402
from prism.engine.sampling import SamplingParams  # noqa: E402
from prism.testing.checkpoints import ensure_tiny_checkpoint  # noqa: E402
from prism.testing.hf_reference import random_images  # noqa: E402

llm = LLM(ensure_tiny_checkpoint(), dtype="float32", page_size=16, num_gpu_pages=64, max_num_batched_tokens=80)
(photo,) = random_images([(320, 480)])  # 150 visual tokens at the checkpoint's settings; a step holds 80
messages = [{"role": "user", "content": [{"type": "image", "image": photo}, {"type": "text", "text": "What is it?"}]}]
try:
    (out,) = llm.generate([messages], SamplingParams(max_tokens=2, temperature=0.0))
    ok, detail = out.finish_reason is not None, f"answered ({out.prompt_tokens} prompt tokens)"
except RequestError as error:
    ok, detail = False, str(error)
_common.verdict(ok, f"a 320x480 photo on an 80-token step is downscaled and {detail}", f"refused: {detail}")
