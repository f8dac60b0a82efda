"""What a GPU copy is told per call: runs of slots in a persistent descriptor ring, written by NumPy alone.

A call of the Triton kernels hands the device no tensor of its own: the host writes one *run* per
block-aligned block (or per token where the slots are not block-aligned, or per state slot) into a
ring of pinned host memory the kernel reads directly (unified addressing), and launches. A run is
:data:`RUN_WORDS` int64: its first slot, its number of consecutive slots, the byte address of the
chunk it moves to or from, that chunk's number of rows, and the chunk row of its first slot. A
kernel computes every address from a run and its bound table; the host does no torch operation, no
allocation and no device read to plan a call.

A region of the ring is handed out again only once the copies that read it completed
(:class:`RingLease`): on a GPU an event the caller recorded after its launch; on the CPU the copies
are done when the launch returns.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from kvgroups.datapath.streams import DONE, Completion
from kvgroups.errors import KVGroupsError

RUN_WORDS = 5
FIRST_SLOT, SLOT_COUNT, CHUNK_ADDRESS, CHUNK_ROWS, FIRST_ROW = range(RUN_WORDS)
# Runs a ring holds at first: a step of 32 token-wise chunks of 256 tokens, or far more block-wise ones.
DEFAULT_RUNS = 8192


class RingLease:
    """Runs ``[start, end)`` of a ring, in use until :meth:`release_after` is given the end of the copies
    that read them."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.completion: Completion | None = None
        self.held: list[torch.Tensor] = []  # what the copies read or write, kept alive until they completed

    def release_after(self, completion: Completion) -> None:
        """The runs may be written again once ``completion`` (the copies that read them) is done."""
        self.completion = completion


class DescriptorRing:
    """A ring of runs in host memory (pinned where a GPU reads it), reused once each region's copies are done.

    ``runs`` is the ring as a ``[capacity, RUN_WORDS]`` int64 array, ``address`` its first byte; ``waits``
    counts the times the host waited for a region's copies before reusing it (a ring too small for the
    copies in flight).
    """

    def __init__(self, *, pin: bool, capacity: int = DEFAULT_RUNS) -> None:
        self.pin = pin
        self.leases: deque[RingLease] = deque()
        self.waits = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.tensor = torch.zeros(capacity * RUN_WORDS, dtype=torch.int64, pin_memory=self.pin)
        self.runs: np.ndarray = self.tensor.numpy().reshape(capacity, RUN_WORDS)
        self.address = int(self.tensor.data_ptr())
        self.capacity = capacity
        self.head = 0  # the next run handed out

    def take(self, count: int) -> RingLease:
        """``count`` consecutive runs that no copy in flight reads (after the last ones taken, unless the ring
        wraps); written by the caller, launched, then released with the launch's completion."""
        if count > self.capacity:
            # More than any call so far: every region in flight is waited for, then a larger ring replaces this one.
            for lease in self.leases:
                self._wait(lease)
            self.leases.clear()
            self._allocate(max(count, 2 * self.capacity))
        start = self.head if self.head + count <= self.capacity else 0
        end = start + count
        kept: deque[RingLease] = deque()
        for lease in self.leases:
            if lease.start < end and start < lease.end:
                self._wait(lease)
            elif lease.completion is None or not lease.completion.query():  # finished ones are forgotten
                kept.append(lease)
        self.leases = kept
        self.head = end
        taken = RingLease(start, end)
        self.leases.append(taken)
        return taken

    def _wait(self, lease: RingLease) -> None:
        if lease.completion is None:
            raise KVGroupsError(f"descriptor runs [{lease.start}, {lease.end}) are still leased: a launch that read "
                                f"them was never released (RingLease.release_after)")
        if not lease.completion.query():
            self.waits += 1
            lease.completion.synchronize()


class Launched:
    """The copies one :meth:`KVTransfer.launch` issued: the descriptor runs they read are reused once the
    caller says they completed (:meth:`release_after`), or :meth:`release` waits for them."""

    def __init__(self, device: torch.device, leases: list[RingLease], asynchronous: bool) -> None:
        self.device = device
        self.leases = leases
        self.asynchronous = asynchronous  # copies across devices queued on the current stream

    def release_after(self, completion: Completion) -> None:
        for lease in self.leases:
            lease.release_after(completion)

    def release(self, synchronize: bool) -> None:
        """Wait for the copies (``synchronize``), or mark their runs reusable after an event recorded now."""
        if self.device.type != "cuda":
            self.release_after(DONE)
            return
        if synchronize:
            if self.leases or self.asynchronous:
                torch.cuda.current_stream(self.device).synchronize()
            self.release_after(DONE)
        elif self.leases:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self.release_after(event)
