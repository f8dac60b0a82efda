"""``memory://``: values in this process, least recently used evicted first, within a byte budget."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from kvgroups.sizes import GIB
from kvgroups.store.base import ByteStore, EntryTooLargeError, StoreStats, check_value

DEFAULT_MAX_BYTES = GIB


class MemoryStore(ByteStore):
    """A dict in insertion order as the LRU list (a hit moves to the end), under one lock."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.url = f"memory://?max_bytes={max_bytes}"
        self.max_bytes = max_bytes
        self._values: dict[str, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes) -> None:
        value = check_value(key, value)
        if len(value) > self.max_bytes:
            raise EntryTooLargeError(
                f"value of {len(value)} bytes for {key!r} exceeds the memory store's budget of {self.max_bytes}"
            )
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._values[key] = value
            self._bytes += len(value)
            while self._bytes > self.max_bytes:
                oldest = next(iter(self._values))
                self._bytes -= len(self._values.pop(oldest))

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._values[key] = value
            return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            found = []
            for key in keys:
                value = self._values.pop(key, None)
                if value is not None:
                    self._values[key] = value
                found.append(value)
            return found

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
