"""Spec of the image token budget (`ImageProcessorConfig.within_tokens`, applied by the engine with its
`max_num_batched_tokens`; `media.image.target_size`): an image is encoded in one step, so a photo larger than a step is downscaled to fit
rather than refused (session 27's review: a 12 MP phone photo was a 400 on the 8B config).

Invariant: under the budgeted settings smart resize brings every image, of any size and aspect ratio up to 50, to at
most the budget's tokens; and an image that already fit under the checkpoint's own settings is resized exactly as
those settings resize it (the budget never changes an image it does not have to). Budgets from four times the
tokens of the checkpoint's `min_pixels` up (256 for Qwen3-VL's 64): smart resize enlarges a small or thin image to
at least `min_pixels`, rounding each side up, which `within_tokens` leaves alone (it would change small images'
preprocessing against HF's); a server's step is thousands of tokens.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prism.media.config import ImageProcessorConfig
from prism.media.image import target_size

QWEN3_VL = ImageProcessorConfig(patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216,
                                image_mean=(0.5,) * 3, image_std=(0.5,) * 3)


def tokens(config: ImageProcessorConfig, height: int, width: int) -> tuple[int, tuple[int, int]]:
    h, w = target_size(height, width, config)
    return h * w // config.factor**2, (h, w)


@settings(max_examples=300, deadline=None)
@given(height=st.integers(32, 8000), aspect=st.floats(0.02, 50.0), budget=st.integers(256, 16384))
def spec_every_image_fits_the_step(height, aspect, budget) -> None:
    width = max(32, min(40000, round(height * aspect)))
    budgeted = QWEN3_VL.within_tokens(budget)
    got, size = tokens(budgeted, height, width)
    assert got <= budget, f"{height}x{width} became {size}: {got} tokens, more than the step's {budget}"
    own, own_size = tokens(QWEN3_VL, height, width)
    if own <= budget:
        assert size == own_size, f"{height}x{width} fit the step ({own} tokens) but was resized to {size}"


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 4000), aspect=st.floats(0.01, 100.0), budget=st.integers(1, 300))
def spec_every_image_fits_even_a_small_step(height, aspect, budget) -> None:
    """Review (session 28): below the tokens of `min_pixels`, or at an extreme aspect, smart resize's rounding up left
    images above the budget (a 64x64 image at 50 tokens; 32x6400 at 100 became 141 tokens), and they were refused.
    Now whole factors come off the longer side until the image fits; an image that fit is still left alone."""
    width = max(1, min(40000, round(height * aspect)))
    if max(height, width) / min(height, width) > 150:
        return  # past smart resize's own aspect limit (200): refused, not resized
    budgeted = QWEN3_VL.within_tokens(budget)
    got, size = tokens(budgeted, height, width)
    assert 1 <= got <= budget, f"{height}x{width} became {size}: {got} tokens, the step has {budget}"
    own, own_size = tokens(QWEN3_VL, height, width)
    if own <= budget:
        assert size == own_size, f"{height}x{width} fit the step ({own} tokens) but was resized to {size}"
