"""Found in session 12 (H200, W5): session 11's tail-copy threshold dropped every partial page below an eighth of a
page and walked the hit back to a page boundary outside images. A prompt of 4 images (198 tokens each with their
markers) at 256-token pages has every page boundary inside an image, so a new question about the same 4 images,
whose shared tail past the last whole page was 29 rows, reused nothing: W5's prefix hit rate fell from 83% to 9%
and its FP8 throughput from 67 to 31 req/s. A short tail is now dropped only where that costs just its rows."""

import _common  # noqa: F401

from prism.engine.config import EngineConfig
from prism.kv.content import MediaSpan, SeqContent
from prism.testing.kv_world import KVWorld

PAGE, PAD = 256, 9
digests = [bytes([d]) * 16 for d in (0xA1, 0xB2, 0xC3, 0xD4)]


def prompt(question: list[int]) -> SeqContent:
    tokens, spans = [1, 2, 3], []  # "<|im_start|>user\n"
    for digest in digests:
        tokens.append(4)  # <|vision_start|>
        spans.append(MediaSpan(len(tokens), 196, digest))
        tokens += [PAD] * 196 + [5]  # the image's tokens, <|vision_end|>
    return SeqContent(tokens + question, tuple(spans))


config = EngineConfig(page_size=PAGE)
world = KVWorld(num_gpu_pages=10, page_size=PAGE, min_tail_tokens=config.tail_copy_threshold)
first = prompt([10, 11, 12, 13] * 5)
world.admit(1, first, chunk=len(first))
world.step()
world.release(1)
again = prompt([20, 21, 22] * 5)  # a new question about the same 4 images
hit = world.manager.lookup(again)
world.check_all()
images_end = 3 + 4 * 198
_common.verdict(
    hit.num_tokens == images_end,
    f"the new question reuses all {images_end} tokens of the images (3 pages + a {hit.tail_rows}-row tail copy)",
    f"the new question reuses {hit.num_tokens} of the {images_end} tokens its 4 images share with the cached prompt",
)
