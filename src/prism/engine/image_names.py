"""Image uuids: a client's names for images it sent (vLLM's `uuid` on an image part).

Owns *a name never changes what it names*: the first image sent with a uuid keeps it; sending another image
with the same uuid is refused. A name is bound to the image's key in the preprocessing cache (its raw
digest), not to the prepared pixels: the pixels may be evicted (naming the uuid then asks the client to send
the image again, which re-fills them under the same name) while the binding, a few dozen bytes, stays. Only
past `max_names` bindings is the least recently used one forgotten; a forgotten name may then be bound anew.
Names are one namespace for every client of a server (as in vLLM): clients that do not trust each other should
use unguessable uuids (a random 128-bit value, or a hash of the image).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..media.cache import CacheKey

DEFAULT_MAX_NAMES = 100_000  # ~30 MB of bindings


class ImageNameConflict(ValueError):
    """A uuid already names a different image."""


class ImageNames:
    def __init__(self, max_names: int = DEFAULT_MAX_NAMES) -> None:
        if not isinstance(max_names, int) or max_names < 1:
            raise ValueError(f"max_names must be a positive int, got {max_names!r}")
        self.max_names = max_names
        self._names: OrderedDict[str, tuple[CacheKey, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, uuid: str, key: CacheKey, digest: bytes) -> None:
        """Name the image stored under `key` (content digest `digest`) `uuid`; ImageNameConflict if `uuid`
        names an image of another digest."""
        self.bind_all([(uuid, key, digest)])

    def check(self, uuid: str, digest: bytes) -> None:
        """ImageNameConflict if `uuid` names an image of another digest (nothing bound, nothing touched)."""
        with self._lock:
            self._check_locked(uuid, digest)

    def _check_locked(self, uuid: str, digest: bytes) -> None:
        known = self._names.get(uuid)
        if known is not None and known[1] != digest:
            raise ImageNameConflict(f"image uuid {uuid!r} already names a different image")

    def bind_all(self, bindings) -> None:
        """Name each (uuid, key, digest): `uuid` names the image stored under `key` (content digest `digest`). All of
        them or none: ImageNameConflict, binding nothing, if any uuid names an image of another digest."""
        with self._lock:
            for uuid, _, digest in bindings:
                self._check_locked(uuid, digest)
            for uuid, key, digest in bindings:
                # The same image may come back as other bytes (another encoding) under another cache key: the name
                # follows the key that was filled last, which holds its pixels.
                self._names[uuid] = (key, digest)
                self._names.move_to_end(uuid)
                if len(self._names) > self.max_names:
                    self._names.popitem(last=False)

    def resolve(self, uuid: str) -> tuple[CacheKey, bytes] | None:
        """(cache key, content digest) of the image `uuid` names, or None for a name not held."""
        with self._lock:
            found = self._names.get(uuid)
            if found is not None:
                self._names.move_to_end(uuid)
            return found

    def __len__(self) -> int:
        return len(self._names)
