"""Noticed in session 11, fixed in session 12: deterministic mode's whole-page hits were walked back to a page
boundary outside images. With 8 images of 198 tokens (W2's prompt) at 256-token pages every page boundary falls
inside an image, so a new question about the same images reused nothing (41.5 ms on the H200 instead of ~7). Its
page-aligned tiles compute an image cut at a page boundary as a miss does (the features taken at an offset), so the
hit now keeps every whole page found (`specs/spec_hit_equals_miss.py` checks the logits bitwise)."""

import _common  # noqa: F401

from prism.kv.content import MediaSpan, SeqContent
from prism.testing.kv_world import KVWorld

PAGE, PAD = 256, 9


def prompt(question: list[int]) -> SeqContent:
    tokens, spans = [1, 2, 3], []  # "<|im_start|>user\n"
    for k in range(8):
        tokens.append(4)  # <|vision_start|>
        spans.append(MediaSpan(len(tokens), 196, bytes([0xA0 + k]) * 16))
        tokens += [PAD] * 196 + [5]  # the image's tokens, <|vision_end|>
    return SeqContent(tokens + question, tuple(spans))


world = KVWorld(num_gpu_pages=16, page_size=PAGE, page_aligned_hits=True)
first = prompt([10, 11, 12, 13] * 5)
world.admit(1, first, chunk=len(first))
world.step()
world.release(1)
hit = world.manager.lookup(prompt([20, 21, 22] * 5))  # a new question about the same 8 images
world.check_all()
whole_pages = (3 + 8 * 198) // PAGE * PAGE
_common.verdict(
    hit.num_tokens == whole_pages,
    f"deterministic mode reuses the {whole_pages // PAGE} whole pages the images fill ({whole_pages} tokens)",
    f"deterministic mode reuses {hit.num_tokens} tokens of the {whole_pages} in whole pages the images fill",
)
