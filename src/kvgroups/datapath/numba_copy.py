"""The CPU kernel's copiers: a group's token rows and recurrent states moved with numba, one compiled call each.

:class:`NumbaTokenCopier` runs :mod:`~kvgroups.datapath.numba_token_kernels` over the raw
addresses of an :mod:`~kvgroups.datapath.address_tables` table, choosing per call one thread or
all, and stores that bypass the cache for unpack and large packs (why: docs/architecture.md);
:class:`NumbaStateCopier` moves state slots. Importing this module imports numba; the data path
does so only when the kernel is chosen.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numba
import numpy as np
import torch
from numba import njit

from kvgroups.core.sizes import MIB
from kvgroups.datapath.address_tables import StateTable, TokenTable, check_still_bound
from kvgroups.datapath.numba_intrinsics import STREAMING_STORES, VECTOR_BYTES, WIDE_VECTOR_BYTES, copy_piece
from kvgroups.datapath.numba_token_kernels import LOCKSTEP_MAX_BYTES, TOKEN_KERNELS
from kvgroups.datapath.slots import CallSlots

# Below this many bytes a call runs on one thread (see the module docstring).
PARALLEL_MIN_BYTES = 4 * MIB
# From this many bytes on, pack writes its chunk with stores that bypass the cache (unpack always does).
STREAMING_MIN_BYTES = 4 * MIB
# numba's workqueue threading layer must not run two parallel regions at once.
_PARALLEL_LOCK = threading.Lock()


_numba_threads = threading.local()  # the thread count this thread last gave numba


def run_parallel(kernel: Any, arguments: tuple[Any, ...], threads: int) -> None:
    """``kernel(*arguments)`` on ``threads`` threads (at most numba's), one parallel kernel at a time, leaving
    torch's thread count as the caller set it.

    Where numba's OpenMP threading layer shares one libgomp with torch (vLLM preloads torch's; a plain
    environment loads the system's for numba beside torch's own), launching a parallel kernel sets the
    calling thread's OpenMP thread count, which is the one torch reads, so a caller that pinned torch
    to one thread would find its ops on every core afterwards. numba's own count is set only when it
    changes (it is the calling thread's, and only this function sets it): after a copy has evicted the
    CPU's caches every Python-level step before the kernel starts costs tens of microseconds.
    """
    threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    torch_threads = torch.get_num_threads()
    with _PARALLEL_LOCK:
        try:
            if getattr(_numba_threads, "count", None) != threads:
                numba.set_num_threads(threads)
                _numba_threads.count = threads
            kernel(*arguments)
        finally:
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)


@njit(nogil=True, cache=True)
def _copy_states(bases: Any, slot_strides: Any, unit_bytes: Any, columns: Any, layers: Any, chunk: int,
                 row_bytes: int, indices: Any, scatter: bool) -> None:
    count = indices.shape[0]
    for item in range(bases.shape[0] * count):
        entry = item // count
        position = item - entry * count
        cache_at = bases[entry] + indices[position] * slot_strides[entry]
        chunk_at = chunk + (layers[entry] * count + position) * row_bytes + columns[entry]
        if scatter:
            copy_piece(cache_at, chunk_at, unit_bytes[entry], False)
        else:
            copy_piece(chunk_at, cache_at, unit_bytes[entry], False)


class NumbaTokenCopier:
    """The copies of one token-indexed group through :data:`~kvgroups.datapath.numba_token_kernels.TOKEN_KERNELS`.

    One kernel call per address table (one for most layouts, one per plane where K and V pages
    are laid out differently).
    """

    def __init__(self, tables: tuple[TokenTable, ...], block_size: int, num_threads: int | None) -> None:
        self.tables = tables
        self.block_size = block_size
        self.num_threads = num_threads
        # Scattered rows WIDE_ROWS at a time, else four, and how many rows ahead a gather asks for
        # (0: none): which is faster depends on the CPU, so the data path measures them once per
        # process and kind of row (kvgroups.datapath.lockstep).
        self.wide = True
        self.ahead = 0
        self.lockstep = "not measured"  # what was chosen, in words
        self.bases = [table.bases.numpy() for table in tables]
        # What every cache-side row address is a multiple of (bases and the strides between rows).
        self.cache_alignment = [
            math.gcd(table.block_stride, table.offset_stride, *(int(base) for base in bases))
            for table, bases in zip(tables, self.bases, strict=True)
        ]

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        slots = call.slot_values
        if slots is None or not slots.size:
            return
        num_bytes = chunk.numel() * chunk.element_size()
        check_still_bound(self.tables[0])  # every table of a group addresses the same tensors
        for index, table in enumerate(self.tables):
            self.launch(index, slots, chunk.data_ptr() + table.chunk_offset(call.num_tokens), num_bytes, scatter,
                        self.wide, self.ahead)

    def launch(self, index: int, slots: np.ndarray, chunk_at: int, num_bytes: int, scatter: bool, wide: bool,
               ahead: int) -> None:
        """Copy ``slots``' rows of table ``index`` to or from the chunk rows at ``chunk_at`` (a chunk of
        ``num_bytes`` in all); ``wide``: scattered rows WIDE_ROWS at a time, else four; ``ahead``: a
        gather of scattered rows asks for the rows that many rows on first."""
        table, bases, cache_alignment = self.tables[index], self.bases[index], self.cache_alignment[index]
        threads = self.num_threads or torch.get_num_threads()
        parallel = threads > 1 and num_bytes >= PARALLEL_MIN_BYTES
        # Stores that bypass the cache pay off where the written rows are not read soon: the caches
        # (unpack), and chunks too large to stay cached (pack). They need 32-byte aligned rows.
        streaming = ((scatter or num_bytes >= STREAMING_MIN_BYTES) and table.rows_contiguous
                     and (cache_alignment if scatter else chunk_at) % VECTOR_BYTES == 0
                     and table.row_bytes % VECTOR_BYTES == 0 and table.chunk_row_bytes % VECTOR_BYTES == 0)
        # Scattered rows move WIDE_ROWS at a time, a cache line each: streaming stores need 64-byte rows.
        wide_streaming = streaming and (cache_alignment if scatter else chunk_at) % WIDE_VECTOR_BYTES == 0 and (
            table.row_bytes % WIDE_VECTOR_BYTES == 0 and table.chunk_row_bytes % WIDE_VECTOR_BYTES == 0)
        # What the kernel does with runs of scattered rows when they are short (it finds the runs).
        lockstep = 0 if not wide or (streaming and not wide_streaming) else 2 if wide_streaming else 1
        # Tokens merge into one run only when a row is one piece in the cache and in the chunk.
        arguments = (bases, chunk_at, slots, self.block_size, table.block_stride, table.offset_stride,
                     table.rows_contiguous and table.chunk_rows_contiguous, table.row_bytes, table.chunk_row_bytes,
                     table.units, table.unit_bytes, table.unit_stride, table.element_bytes, table.element_stride,
                     streaming, lockstep, 0 if scatter else ahead)
        kernel = TOKEN_KERNELS[parallel, scatter]
        if parallel:
            run_parallel(kernel, arguments, threads)
        else:
            kernel(*arguments)

    @property
    def scattered_rows(self) -> bool:
        """Whether this group's rows can move in lockstep when scattered (one short piece per token)."""
        table = self.tables[0]
        return table.units == 1 and table.elements_contiguous and table.row_bytes <= LOCKSTEP_MAX_BYTES


class NumbaStateCopier:
    """The copies of one recurrent group through :func:`_copy_states`, by state slot."""

    def __init__(self, table: StateTable) -> None:
        self.table = table
        self.arrays = tuple(tensor.numpy() for tensor in (table.bases, table.slot_strides, table.unit_bytes,
                                                          table.columns, table.layers))

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.state_values is None or not call.num_states:
            return
        check_still_bound(self.table)
        _copy_states(*self.arrays, chunk.data_ptr(), self.table.row_bytes, call.state_values, scatter)


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel now, copying a few bytes between two buffers.

    The first call of each kernel otherwise compiles it in the middle of a copy: seconds on a
    new machine, which a latency-sensitive caller pays at startup instead.
    """
    # Streaming stores need 32-byte aligned destinations: both buffers start on a 64-byte boundary.
    memory = np.zeros(512, dtype=np.uint8)
    start = -memory.ctypes.data % 64
    source, target = memory[start:start + 64], memory[start + 128:start + 192]
    bases = np.array([source.ctypes.data], dtype=np.int64)
    slots = np.array([0, 1], dtype=np.int64)
    # Gathers first (source to target), then scatters (target back to source, the same bytes).
    for (parallel, _), kernel in sorted(TOKEN_KERNELS.items(), key=lambda item: item[0][1]):
        for streaming in (False, STREAMING_STORES):
            arguments = (bases, target.ctypes.data, slots, 2, 64, 32, True, 32, 32, 1, 32, 32, 4, 4, streaming,
                         2 if streaming else 1, 1)
            if parallel:
                run_parallel(kernel, arguments, numba.config.NUMBA_NUM_THREADS)
            else:
                kernel(*arguments)
    if not np.array_equal(source, target):
        raise RuntimeError("the numba copy kernel failed its warm-up copy")
    one = np.zeros(1, dtype=np.int64)
    _copy_states(bases, np.array([32], dtype=np.int64), np.array([32], dtype=np.int64), one, one, target.ctypes.data,
                 32, one, False)

