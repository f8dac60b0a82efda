"""Which entries this process knows were stored (it wrote them, or a lookup found them), so that one a later
lookup finds missing is counted as vanished: lost with a failed-over master that had not yet passed it to its
replica, evicted (a server's ``maxmemory``, another process's budget), expired or deleted behind the store's
back. Nothing else tells an operator that a store handed back less than it acknowledged."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

# Entries remembered (the most recently seen): a few MB, beyond which the oldest are forgotten, uncounted.
SEEN_ENTRIES = 1 << 16


class SeenEntries:
    """A bounded memory of entry keys known to be stored, the most recently seen kept; thread-safe."""

    def __init__(self, capacity: int = SEEN_ENTRIES) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def stored(self, keys: Iterable[str]) -> None:
        """``keys`` are stored now (written, or found)."""
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def vanished(self, keys: Iterable[str]) -> int:
        """Of ``keys``, found missing now, how many were known stored (forgotten now: counted once)."""
        count = 0
        with self._lock:
            for key in keys:
                if self._keys.pop(key, 0) is None:
                    count += 1
        return count

    def held(self, keys: Iterable[str]) -> int:
        """How many of ``keys`` are known stored."""
        with self._lock:
            return sum(key in self._keys for key in keys)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()

    def forget(self, keys: Iterable[str]) -> None:
        """``keys`` were deleted on purpose (a corrupt entry discarded): not vanished when missing later."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)
