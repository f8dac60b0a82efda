"""``memory://``: values in this process, least recently used evicted first, within a byte budget."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvgroups.core.sizes import GIB
from kvgroups.store.backends.base import ByteStore, EntryTooLargeError, Stored, StoreStats, Value, check_value, cut

DEFAULT_MAX_BYTES = GIB


class MemoryStore(ByteStore):
    """A dict in insertion order as the LRU list, under one lock for writes.

    Reads take no lock: a hit is noted in a dict of recent hits (one C call; bounded by the number
    of keys), and the hits are applied to the LRU order (moved to the end) when the store is about
    to evict, so that eviction still sees every read.
    """

    tier_name = "memory"

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.url = f"memory://?max_bytes={max_bytes}"
        self.max_bytes = max_bytes
        self._values: dict[str, bytes] = {}
        self._hits: dict[str, None] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def _apply_hits(self) -> None:
        """Move the keys read since the last call to the end of the LRU order (under the lock)."""
        hits, self._hits = self._hits, {}
        values = self._values
        for key in hits:
            value = values.pop(key, None)
            if value is not None:
                values[key] = value

    def put(self, key: str, value: Value) -> None:
        checked = check_value(key, value)
        # bytes cannot change under us; anything else is copied, since its owner may reuse it.
        value = checked if isinstance(checked, bytes) else bytes(checked)
        if len(value) > self.max_bytes:
            raise EntryTooLargeError(
                f"value of {len(value)} bytes for {key!r} exceeds the memory store's budget of {self.max_bytes}"
            )
        evicted: list[str] = []
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._values[key] = value
            self._bytes += len(value)
            if self._bytes > self.max_bytes:
                self._apply_hits()
                while self._bytes > self.max_bytes:
                    oldest = next(iter(self._values))
                    self._bytes -= len(self._values.pop(oldest))
                    self.evictions += 1
                    evicted.append(oldest)
        listener = self.eviction_listener
        if evicted and listener is not None:
            listener(evicted)

    def gauges(self) -> dict[str, float]:
        return {"entries": float(len(self._values)), "bytes": float(self._bytes), "evictions": float(self.evictions)}

    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        value = self._values.get(key)
        if value is None:
            return None
        self._hits[key] = None
        return cut(value, max_bytes)

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[Stored | None]:
        return [self.get(key, max_bytes) for key in keys]

    def contains(self, key: str) -> bool:
        return key in self._values

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        values = self._values
        return [key in values for key in keys]

    def delete(self, key: str) -> bool:
        with self._lock:
            value = self._values.pop(key, None)
            if value is None:
                return False
            self._bytes -= len(value)
            return True

    def iter_keys(self) -> Iterator[str]:
        with self._lock:
            self._apply_hits()
            keys = list(self._values)
        return iter(keys)

    def size_of(self, key: str) -> int | None:
        value = self._values.get(key)
        return None if value is None else len(value)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(entries=len(self._values), bytes=self._bytes)

    def clear(self) -> int:
        with self._lock:
            count = len(self._values)
            self._values.clear()
            self._bytes = 0
            return count
