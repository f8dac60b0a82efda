"""Host buffers reused across copies: chunks for ``pack`` calls without ``out=``, buffers for queued
saves (:class:`HostBufferPool`) and the buffers loads read entries into (:class:`ReadBuffers`).

Page-faulting a fresh 32 MiB tensor costs this kind of machine about twice what copying a chunk
into it does, and torch's CPU allocator returns large blocks to the system. A :class:`ChunkPool`
keeps a few storages per size and hands one out again only when no tensor, view or NumPy array
made from its last chunk is alive (the storage's reference count says so), so a returned chunk
is never overwritten behind its holder's back.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np
import torch

from kvgroups.datapath.streams import DONE, Completion

# The number of references a pooled storage has when only the pool holds it.
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _contiguous_strides(shape: torch.Size) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


class ChunkPool:
    """Up to ``per_size`` storages per byte size on ``device``."""

    def __init__(self, device: torch.device, per_size: int = 2) -> None:
        self.device = device
        self.per_size = per_size
        self._storages: dict[int, list[torch.UntypedStorage]] = {}

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor, in reused memory where some is free."""
        num_bytes = math.prod(shape) * dtype.itemsize
        if not num_bytes or _use_count is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        storages = self._storages.setdefault(num_bytes, [])
        storage = next((held for held in storages if _use_count(held._cdata) == 1), None)
        if storage is None:
            storage = torch.empty(num_bytes, dtype=torch.uint8, device=self.device).untyped_storage()
            if len(storages) < self.per_size:
                storages.append(storage)
        chunk = torch.empty(0, dtype=dtype, device=self.device)
        return chunk.set_(storage, 0, shape, _contiguous_strides(shape))

    def clear(self) -> None:
        """Forget every pooled storage (the memory goes once no chunk holds it)."""
        self._storages.clear()


class HostBufferPool:
    """Host memory for chunks on their way to a store: at most ``max_bytes``, pinned when the caches
    are on an accelerator (so that copies out of device memory are asynchronous DMA).

    Saves hold their chunks here rather than in device memory, outside the engine's accounting;
    :meth:`take` hands out buffers while the budget allows (None when it does not: the caller
    drops that save) and :meth:`give_back` returns them for reuse.
    """

    def __init__(self, max_bytes: int, pin: bool) -> None:
        self.max_bytes = max_bytes
        self.pin = pin
        self.held_bytes = 0  # allocated, in use or free
        self._free: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor] | None:
        """One buffer per ``(shape, dtype)``, in order, all or none (None: over the budget)."""
        with self._lock:
            taken: list[tuple[torch.Tensor, bool]] = []  # (buffer, allocated now)
            for shape, dtype in shapes:
                free = self._free.get((shape, dtype))
                if free:
                    taken.append((free.pop(), False))
                    continue
                needed = math.prod(shape) * dtype.itemsize
                if self.held_bytes + needed > self.max_bytes:
                    self._drop_free()
                if self.held_bytes + needed > self.max_bytes:
                    # Nothing is handed out: reused buffers go back, new ones go.
                    self._release([buffer for buffer, new in taken if not new])
                    self.held_bytes -= sum(_bytes(buffer) for buffer, new in taken if new)
                    return None
                self.held_bytes += needed
                taken.append((torch.empty(shape, dtype=dtype, pin_memory=self.pin), True))
            return [buffer for buffer, _ in taken]

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            self._release(buffers)

    def _release(self, buffers: list[torch.Tensor]) -> None:
        for buffer in buffers:
            self._free.setdefault((buffer.shape, buffer.dtype), []).append(buffer)

    def _drop_free(self) -> None:
        """Let go of every free buffer (other shapes may need the room)."""
        for buffers in self._free.values():
            self.held_bytes -= sum(_bytes(buffer) for buffer in buffers)
        self._free.clear()


def _bytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


class ReadBuffers:
    """Host buffers a reader fills in turn: pinned where the copies out of them go to a GPU (so that the
    copies run asynchronously), and each refilled only once the copy out of it has completed.

    An entry read into a buffer is *queued* until the launch that copies it (:meth:`launched`): a reader
    fills buffers until :meth:`all_queued`, then launches the copies of all of them at once. With two
    buffers the next entry is read while the last one is still being copied to the device.
    """

    def __init__(self, size: int, *, pin: bool, count: int = 2) -> None:
        self._tensors = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        self._arrays = [tensor.numpy() for tensor in self._tensors]
        self._copies: list[Completion] = [DONE] * count
        self._queued: list[int] = []  # buffers holding entries whose copies are not launched yet
        self._next = 0

    @property
    def count(self) -> int:
        return len(self._arrays)

    def take(self) -> tuple[int, np.ndarray]:
        """The next buffer (its index, and its bytes as an array), once the last copy out of it is done."""
        index = self._next
        if index in self._queued:
            raise RuntimeError("every read buffer holds an entry whose copy is not launched; launch them first")
        self._next = (index + 1) % len(self._arrays)
        self._copies[index].synchronize()
        return index, self._arrays[index]

    def take_free(self, limit: int) -> list[tuple[int, np.ndarray]]:
        """Up to ``limit`` buffers in turn (:meth:`take`), each at most once, stopping at one that holds an entry
        whose copy is not launched yet: the buffers a batch of reads may fill at once."""
        taken: list[tuple[int, np.ndarray]] = []
        while len(taken) < min(limit, len(self._arrays)) and not self.all_queued():
            taken.append(self.take())
        return taken

    def queued(self, index: int) -> None:
        """Buffer ``index`` holds an entry whose copy is queued for the next launch."""
        self._queued.append(index)

    def all_queued(self) -> bool:
        """Whether the next buffer still holds an entry whose copy is not launched."""
        return self._next in self._queued

    def launched(self, copies: Completion) -> None:
        """The queued buffers are being copied from until ``copies`` completes."""
        for index in self._queued:
            self._copies[index] = copies
        self._queued.clear()
