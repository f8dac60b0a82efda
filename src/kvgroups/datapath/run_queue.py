"""One group's moves queued for one launch, planned into descriptor runs by NumPy alone, into reused arrays;
the copiers that launch them (:class:`RunCopier`).

A move is a chunk (its byte address and rows) and the slots it fills or is filled from. Slots that
cover whole blocks in order (``block_id * block_size + 0 .. block_size - 1``, as an engine's blocks
of a block-aligned chunk) travel as one run per block; any others as one run per token. A move may
name the chunk row of each slot (a load whose first slots are already in the engine's cache). What
the check needs (scratch arrays, a row count) is kept between calls, so a call of a size seen
before allocates nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvgroups.datapath.descriptors import (
    FIRST_ROW,
    FIRST_SLOT,
    SLOT_COUNT,
    DescriptorRing,
    RingLease,
)
from kvgroups.datapath.streams import DONE

# The reductions themselves, without ndarray methods' Python wrappers (a microsecond each, several a call).
_bitwise_or, _minimum, _maximum = np.bitwise_or.reduce, np.minimum.reduce, np.maximum.reduce
# A launch: the kernel, its grid, positional arguments and constants. Tests and benchmarks replace it.
Launch = Callable[[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any]], None]
# (chunk address, chunk rows, slots, chunk row of each slot or None for 0.., whole blocks at the front)
Move = tuple[int, int, np.ndarray, np.ndarray | None, int]


class RunQueue:
    """The moves of one group and direction until the next launch; ``block_size`` 0 for state slots."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.moves: list[Move] = []
        self.held: list[torch.Tensor] = []  # the chunks moved to or from
        self.num_runs = 0
        self.longest_run = 1
        self.alignment = 1 << 62  # the largest power of two dividing every chunk address queued
        self._rows = np.arange(0, dtype=np.int64)
        self._scratch = np.empty(0, dtype=np.int64)

    def add(self, chunk: torch.Tensor, chunk_rows: int, slots: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Queue a move of ``slots`` (int64) to or from ``chunk`` (of ``chunk_rows`` rows), held until the copies
        that read or write it completed (a chunk freed before could be handed to other data)."""
        if not slots.size:
            return
        chunk_address = chunk.data_ptr()
        self.held.append(chunk)
        whole = 0 if rows is not None or not self.block_size else self._whole_blocks(slots)
        self.moves.append((chunk_address, chunk_rows, slots, rows, whole))
        self.num_runs += whole // self.block_size + slots.size - whole if whole else slots.size
        if whole:
            self.longest_run = self.block_size
        self.alignment = min(self.alignment, chunk_address & -chunk_address) if chunk_address else self.alignment
        if slots.size > self._rows.size:
            self._rows = np.arange(slots.size, dtype=np.int64)

    def _whole_blocks(self, slots: np.ndarray) -> int:
        """How many of the first slots fill whole blocks, each in order (0 when they do not all do).

        Only one-dimensional, contiguous NumPy passes into reused arrays: broadcast or strided ones
        allocate buffers of the call's size."""
        block = self.block_size
        whole = slots.size - slots.size % block
        if not whole:
            return 0
        if whole > self._scratch.size:
            self._scratch = np.empty(whole, dtype=np.int64)
            if whole > self._rows.size:
                self._rows = np.arange(whole, dtype=np.int64)
        heads = slots[:whole:block]
        if block & (block - 1) == 0:  # a power of two: every head is a multiple iff their OR is
            if int(_bitwise_or(heads)) & (block - 1):
                return 0
        else:
            remainders = self._scratch[:heads.size]
            np.remainder(heads, block, out=remainders)
            if _bitwise_or(remainders):
                return 0
        # Step from each slot to the next: 1 inside every block; a block's last step (to the next block) is anything.
        steps = self._scratch[:whole]
        np.subtract(slots[1:whole], slots[:whole - 1], out=steps[:whole - 1])
        steps.reshape(-1, block)[:, block - 1] = 1
        return whole if _minimum(steps) == 1 and _maximum(steps) == 1 else 0

    def write(self, runs: np.ndarray) -> None:
        """Write the queued moves' runs into ``runs`` (``[num_runs, RUN_WORDS]`` of a descriptor ring)."""
        at = 0
        block = self.block_size
        for address, chunk_rows, slots, rows, whole in self.moves:
            if whole:
                count = whole // block
                written = runs[at:at + count]
                written[:, FIRST_SLOT] = slots[:whole:block]
                written[:, SLOT_COUNT:FIRST_ROW] = (block, address, chunk_rows)
                written[:, FIRST_ROW] = self._rows[:whole:block]
                at += count
            rest = slots.size - whole
            if rest:
                written = runs[at:at + rest]
                written[:, FIRST_SLOT] = slots[whole:]
                written[:, SLOT_COUNT:FIRST_ROW] = (1, address, chunk_rows)
                written[:, FIRST_ROW] = self._rows[whole:slots.size] if rows is None else rows
                at += rest

    def clear(self) -> None:
        self.moves.clear()
        self.held = []
        self.num_runs = 0
        self.longest_run = 1
        self.alignment = 1 << 62


def launch(kernel: Any, grid: tuple[int, int, int], arguments: tuple[Any, ...], constants: dict[str, Any]) -> None:
    """A Triton kernel's launch on the current stream."""
    kernel[grid](*arguments, **constants)


class RunCopier:
    """What both kinds of run copier share: a ring per copier, a queue per direction, one launch per queue."""

    params: torch.Tensor
    word_bytes: int

    def __init__(self, device: torch.device, block_size: int, max_runs: int) -> None:
        self.device = device
        self.max_runs = max_runs  # runs one launch may address (a grid's axis)
        self.block_size = block_size
        self.ring = DescriptorRing(pin=device.type == "cuda")
        self._ring_lock = threading.Lock()
        self._local = threading.local()  # each thread's queues: loads run on several threads at once
        self.launch: Launch = launch

    def queue(self, scatter: bool) -> RunQueue:
        """The calling thread's queue of one direction."""
        queues: dict[bool, RunQueue] | None = getattr(self._local, "queues", None)
        if queues is None:
            queues = self._local.queues = {False: RunQueue(self.block_size), True: RunQueue(self.block_size)}
        return queues[scatter]

    def launch_queued(self, scatter: bool) -> RingLease | None:
        """Launch the calling thread's queued moves of one direction, all in one launch; the ring runs they read."""
        queue = self.queue(scatter)
        if not queue.num_runs:
            queue.clear()
            return None
        self.check_bound()
        with self._ring_lock:
            lease = self.ring.take(queue.num_runs)
        queue.write(self.ring.runs[lease.start:lease.end])
        lease.held = queue.held  # alive until the lease is retired, after the copies completed
        word = min(self.word_bytes, queue.alignment)
        try:
            for first in range(lease.start, lease.end, self.max_runs):
                self.launch_runs(first, min(self.max_runs, lease.end - first), queue.longest_run, word, scatter)
        except BaseException:
            # What was launched may still read the runs: wait for it, so that the ring never holds a lease
            # nobody releases.
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            lease.release_after(DONE)
            raise
        finally:
            queue.clear()
        return lease

    def check_bound(self) -> None:
        """Raise when a tensor the copier addresses was reallocated since it was bound."""
        raise NotImplementedError

    def launch_runs(self, first: int, count: int, longest: int, word: int, scatter: bool) -> None:
        """Launch the kernel on ring runs ``first ..`` (``count`` of them, the longest of ``longest`` slots),
        moving words of ``word`` bytes."""
        raise NotImplementedError
