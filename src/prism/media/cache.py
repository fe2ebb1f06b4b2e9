"""Thread-safe LRU cache of preprocessed media, keyed by (raw-byte digest, processor namespace).

Owns: reuse of CPU preprocessing (decode, resize, normalize, patchify, content digest) across requests and
across the offline, online and HTTP paths. Bounded by the bytes of the cached values; least recently used
entries are evicted first. Hit / miss counters count media items (images), the unit of `/metrics`'
media-cache queries and hits.

`get_or_compute` runs the computation outside the lock, so a slow decode never blocks other lookups; two
threads missing the same key at once may both compute it (the second store just refreshes the entry).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import MediaError

V = TypeVar("V")


@dataclass(frozen=True)
class CacheKey:
    """raw_digest: digest of the encoded bytes; namespace: model id + processor fingerprint."""

    raw_digest: bytes
    namespace: str


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    max_bytes: int


class PreprocessCache(Generic[V]):
    """LRU map CacheKey -> value, bounded by the sum of the values' declared sizes in bytes."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise MediaError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[CacheKey, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: CacheKey) -> V | None:
        """The cached value (now most recently used) or None; counts one hit or one miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry[0]

    def put(self, key: CacheKey, value: V, nbytes: int) -> bool:
        """Store (or refresh) an entry; evicts LRU entries to fit. A value larger than the whole cache is
        not stored (returns False)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise MediaError(f"nbytes must be a non-negative int, got {nbytes!r}")
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if nbytes > self._max_bytes:
                return False
            while self._bytes + nbytes > self._max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self._bytes -= freed
                self._evictions += 1
            self._entries[key] = (value, nbytes)
            self._bytes += nbytes
            return True

    def get_or_compute(self, key: CacheKey, compute: Callable[[], tuple[V, int]]) -> V:
        """Cached value, or `compute()` -> (value, nbytes) stored and returned. Exceptions from compute
        propagate and store nothing."""
        value = self.get(key)
        if value is not None:
            return value
        value, nbytes = compute()
        self.put(key, value, nbytes)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                entries=len(self._entries),
                bytes=self._bytes,
                max_bytes=self._max_bytes,
            )
