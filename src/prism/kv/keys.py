"""Page keys: a chained, length-framed, 128-bit hash of everything a page's KV depends on.

Owns half of *prefix identity* (invariant 7): key(page j) = H(key(page j-1), token ids of page j, media
tags of page j), rooted in a namespace key (model + processor settings). Every field is length-framed so
no two different inputs serialize to the same bytes. The other half is verification: the prefix index
also stores each page's tokens, media and parent and compares them on lookup, so even a hash collision
cannot serve foreign KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from .content import MediaRun, SeqContent

KEY_BYTES = 16  # 128 bits
_PAGE_TAG = b"prism.page.v1"
_ROOT_TAG = b"prism.root.v1"


_U64 = struct.Struct("<Q").pack
_RUN = struct.Struct("<QQQ").pack


def _framed(*fields: bytes) -> bytes:
    return b"".join([_U64(len(f)) + f for f in fields])


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def root_key(namespace: str) -> bytes:
    """The parent key of page 0: different models or processor settings never share pages."""
    return _hash(_framed(_ROOT_TAG, namespace.encode()))


def encode_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def encode_media(media: Sequence[MediaRun]) -> bytes:
    return b"".join([_framed(_RUN(m.row, m.length, m.offset), m.digest) for m in media])


def page_key(parent: bytes, tokens: Sequence[int], media: Sequence[MediaRun]) -> bytes:
    """Key of one full page given its parent's key."""
    return _hash(_framed(_PAGE_TAG, parent, encode_tokens(tokens), encode_media(media)))


def page_chain(content: SeqContent, root: bytes, page_size: int, max_tokens: int | None = None):
    """(parent key, tokens, media runs, key) of each full page of `content` in order, within its first `max_tokens`
    tokens (default all): the keys the index records once those pages are computed."""
    limit = len(content) if max_tokens is None else min(max_tokens, len(content))
    parent = root
    for start in range(0, limit - page_size + 1, page_size):
        tokens = tuple(content.tokens[start : start + page_size])
        media = content.media_runs(start, start + page_size)
        key = page_key(parent, tokens, media)
        yield parent, tokens, media, key
        parent = key


def chain_keys(content: SeqContent, root: bytes, page_size: int) -> list[bytes]:
    """The keys of every full page of `content`: two sequences hold the same KV in their first j pages exactly where
    their first j keys are equal."""
    return [key for *_, key in page_chain(content, root, page_size)]
