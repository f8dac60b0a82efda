"""Buffers a tier reads batches into, used again once nothing holds a view of them.

A batch read into new memory pays for its pages as the read touches them (on a VM, as long as the read
itself: about 0.5 ms a MiB), and glibc hands a freed batch's memory back to the kernel, so every batch
pays again. A server's own client reads into buffers it keeps. So do these tiers: a read takes a buffer
from a :class:`BufferPool` and hands out views of it; the buffer is taken again once every view of it
(a memoryview, a slice of one, a tensor made from one) is gone, which CPython's reference count of
the buffer says exactly (each view holds a reference to the array it exports, however derived). The pool
keeps at most ``max_bytes`` of buffers; beyond that a read gets a buffer of its own, not kept.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

DEFAULT_POOL_BYTES = 512 << 20
# References to a pooled buffer nobody else holds, as counted below: the pool's list, the loop's name, and
# sys.getrefcount's own argument.
_UNHELD = 3


class BufferPool:
    """Byte buffers (uint8 NumPy arrays, uninitialised) for reads, reused once no view of them is left."""

    def __init__(self, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` bytes that no one else holds (the smallest such kept one, else a new
        one). The caller hands out views of it; it is free again when they and the caller's reference are gone."""
        nbytes = max(nbytes, 1)
        with self._lock:
            best: np.ndarray | None = None
            for buffer in self._buffers:
                if buffer.nbytes >= nbytes and sys.getrefcount(buffer) <= _UNHELD and \
                        (best is None or buffer.nbytes < best.nbytes):
                    best = buffer
            if best is not None:
                return best
            kept = sum(buffer.nbytes for buffer in self._buffers)
            fresh = np.empty(nbytes, dtype=np.uint8)
            if kept + nbytes <= self.max_bytes:
                self._buffers.append(fresh)
            else:
                self._drop_unheld(kept + nbytes - self.max_bytes)
                if sum(buffer.nbytes for buffer in self._buffers) + nbytes <= self.max_bytes:
                    self._buffers.append(fresh)
            return fresh

    def _drop_unheld(self, nbytes: int) -> None:
        """Forget free buffers, largest first, until ``nbytes`` are forgotten (or none is free)."""
        for buffer in sorted(self._buffers, key=lambda kept: -kept.nbytes):
            if nbytes <= 0:
                return
            if sys.getrefcount(buffer) <= _UNHELD + 1:  # the sorted list holds it too
                self._buffers = [kept for kept in self._buffers if kept is not buffer]
                nbytes -= buffer.nbytes

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(buffer.nbytes for buffer in self._buffers)
