"""Peers' failure: a second image reused the first image's KV because matching was on placeholder tokens.
Fixed when identical placeholder tokens with other pixels (another digest) never hit, the same pixels do,
and a changed left context before the same image misses too."""

import _common  # noqa: F401

from prism.kv.content import MediaSpan, SeqContent
from prism.testing.kv_world import KVWorld

world = KVWorld(num_gpu_pages=32, page_size=4)
cat, dog = b"\xca" * 16, b"\xd0" * 16
tokens = [1] + [9] * 8 + [2, 3, 4]
world.admit(1, SeqContent(list(tokens), (MediaSpan(1, 8, cat),)), chunk=len(tokens))
world.step()
other_pixels = world.admit(2, SeqContent(list(tokens), (MediaSpan(1, 8, dog),)), chunk=len(tokens))
same_pixels = world.admit(3, SeqContent(list(tokens), (MediaSpan(1, 8, cat),)), chunk=len(tokens))
other_left = world.admit(4, SeqContent([5] + tokens[1:], (MediaSpan(1, 8, cat),)), chunk=len(tokens))
world.step()
world.check_all()
_common.verdict(
    other_pixels == 1 and same_pixels == 11 and other_left == 0,
    "other pixels reuse only the text before the image (1 token); same pixels reuse 11; other left context 0",
    f"hits: other pixels {other_pixels} (want 1), same pixels {same_pixels} (want 11), other left context {other_left} (want 0)",
)
