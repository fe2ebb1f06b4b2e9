"""Decoded payloads of recently seen data URLs (W2 over HTTP re-sends the same 8 images as ~6 MB of base64).

Owns: skipping the base64 decode of a data URL seen before without ever trusting a fingerprint. An entry is
found by a sampled key (the length and three 64-character windows) and used only when its whole URL equals the
request's, a memory compare about 20x cheaper than decoding. Bounded by the bytes it holds (URL text plus
payload), least recently used first. Thread-safe: the media worker pool resolves several requests at once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

_WINDOW = 64


def _sample_key(url: str) -> tuple[int, str, str, str]:
    mid = len(url) // 2
    return len(url), url[:_WINDOW], url[mid : mid + _WINDOW], url[-_WINDOW:]


class DecodedDataURLs:
    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, str, str, str], tuple[str, bytes]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, url: str) -> bytes | None:
        key = _sample_key(url)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != url:  # same samples, other URL: a miss, never a wrong payload
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[1]

    def put(self, url: str, payload: bytes) -> None:
        size = len(url) + len(payload)
        if size > self.max_bytes:
            return
        key = _sample_key(url)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0]) + len(old[1])
            self._entries[key] = (url, payload)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (u, p) = self._entries.popitem(last=False)
                self._bytes -= len(u) + len(p)

    @property
    def nbytes(self) -> int:
        return self._bytes
