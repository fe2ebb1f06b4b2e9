"""Hypothesis strategies for sequence contents that collide often: tiny vocabularies, a few images with
identical placeholder tokens but different pixels, and prompts grown from earlier prompts' prefixes."""

from __future__ import annotations

from hypothesis import strategies as st

from prism.kv.content import MediaSpan, SeqContent

IMAGE_PAD = 9
DIGESTS = [bytes([d]) * 16 for d in (0xA1, 0xB2, 0xC3)]


@st.composite
def blocks(draw: st.DrawFn) -> tuple[list[int], bytes | None]:
    """A text block (tokens 1..3) or an image block (pad tokens with one of three digests)."""
    if draw(st.booleans()):
        return draw(st.lists(st.integers(1, 3), min_size=1, max_size=5)), None
    return [IMAGE_PAD] * draw(st.integers(2, 6)), draw(st.sampled_from(DIGESTS))


def build(parts: list[tuple[list[int], bytes | None]]) -> SeqContent:
    tokens: list[int] = []
    media = []
    for part_tokens, digest in parts:
        if digest is not None:
            media.append(MediaSpan(len(tokens), len(part_tokens), digest))
        tokens += part_tokens
    return SeqContent(tokens, tuple(media))


@st.composite
def contents(draw: st.DrawFn, earlier: list[list[tuple[list[int], bytes | None]]] | None = None) -> list:
    """Block lists; half the time extending a prefix (whole blocks) of an earlier prompt."""
    parts: list[tuple[list[int], bytes | None]] = []
    if earlier and draw(st.booleans()):
        base = draw(st.sampled_from(earlier))
        parts = list(base[: draw(st.integers(0, len(base)))])
    parts += draw(st.lists(blocks(), min_size=0 if parts else 1, max_size=3))
    if not parts:
        parts = [([1], None)]
    return parts
