"""The CPU kernel: every (plane, layer, token run) of a group copied with memcpy in one compiled call.

Built with numba (``njit(nogil=True, cache=True)``) over the raw addresses of an
:mod:`~kvgroups.datapath.address_tables` table; runs of scattered rows move four at a time in
lockstep, unpack and large packs with stores that bypass the cache (why: docs/architecture.md).
Importing this module imports numba; the data path does so only when the kernel is chosen.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import numba
import numpy as np
import torch
from numba import njit, prange

from kvgroups.core.sizes import MIB
from kvgroups.datapath.address_tables import StateTable, TokenTable, check_still_bound
from kvgroups.datapath.numba_intrinsics import (
    STREAMING_STORES,
    VECTOR_BYTES,
    WIDE_ROWS,
    WIDE_VECTOR_BYTES,
    copy_piece,
    copy_pieces,
    copy_wide,
    move_element,
    prefetch_rows,
)
from kvgroups.datapath.slots import CallSlots

# Below this many bytes a call runs on one thread (see the module docstring).
PARALLEL_MIN_BYTES = 4 * MIB
# From this many bytes on, pack writes its chunk with stores that bypass the cache (unpack always does).
STREAMING_MIN_BYTES = 4 * MIB
# numba's workqueue threading layer must not run two parallel regions at once.
_PARALLEL_LOCK = threading.Lock()
_LOCKSTEP_MAX_BYTES = 8192  # runs up to this long are copied in lockstep (into the cache too)
_GROUP = WIDE_ROWS  # runs per work item


@contextlib.contextmanager
def parallel_region() -> Iterator[None]:
    """One parallel kernel at a time, leaving torch's thread count as the caller set it.

    numba's OpenMP threading layer shares libgomp with torch: launching a parallel kernel sets the
    calling thread's OpenMP thread count, which is the one torch reads, so a caller that pinned torch
    to one thread would find its ops on every core afterwards.
    """
    torch_threads = torch.get_num_threads()
    with _PARALLEL_LOCK:
        try:
            yield
        finally:
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)


@njit(nogil=True, cache=True)
def _token_runs(slots: Any, block_size: int, block_stride: int, offset_stride: int, run_bytes: int,
                merge: bool) -> Any:
    """Runs of tokens whose rows follow each other in the cache: (first token, byte offset, length)."""
    count = slots.shape[0]
    first = np.empty(count, np.int64)
    offset = np.empty(count, np.int64)
    length = np.empty(count, np.int64)
    runs = 0
    previous = -1
    for token in range(count):
        block = slots[token] // block_size
        position = block * block_stride + (slots[token] - block * block_size) * offset_stride
        if merge and runs and position == previous + run_bytes:
            length[runs - 1] += 1
        else:
            first[runs] = token
            offset[runs] = position
            length[runs] = 1
            runs += 1
        previous = position
    return first[:runs], offset[:runs], length[:runs]


@njit(nogil=True, cache=True, inline="always")
def _copy_group(item: int, bases: Any, chunk: int, num_tokens: int, row_bytes: int, chunk_row_bytes: int,
                first: Any, offset: Any, length: Any, scatter: bool, streaming: bool, wide: int, ahead: int) -> None:
    """Runs ``16g .. 16g + 15`` of one (plane, layer) where every run is short (``wide``: scattered rows),
    all in lockstep when they are as long, a cache line of each in turn (``wide`` 2: with streaming
    stores); else runs ``4g .. 4g + 3``. A gather with ``ahead`` asks first for the first line of the
    rows that many rows on (their misses and page walks then overlap this copy)."""
    per_item = _GROUP if wide else 4
    items = (first.shape[0] + per_item - 1) // per_item
    plane = item // items
    run = (item - plane * items) * per_item
    if wide and run + _GROUP <= first.shape[0] and _same_lengths(length, run):
        base = bases[plane]
        at = chunk + (plane * num_tokens) * chunk_row_bytes
        caches = (base + offset[run], base + offset[run + 1], base + offset[run + 2], base + offset[run + 3],
                  base + offset[run + 4], base + offset[run + 5], base + offset[run + 6], base + offset[run + 7],
                  base + offset[run + 8], base + offset[run + 9], base + offset[run + 10], base + offset[run + 11],
                  base + offset[run + 12], base + offset[run + 13], base + offset[run + 14], base + offset[run + 15])
        chunks = (at + first[run] * chunk_row_bytes, at + first[run + 1] * chunk_row_bytes,
                  at + first[run + 2] * chunk_row_bytes, at + first[run + 3] * chunk_row_bytes,
                  at + first[run + 4] * chunk_row_bytes, at + first[run + 5] * chunk_row_bytes,
                  at + first[run + 6] * chunk_row_bytes, at + first[run + 7] * chunk_row_bytes,
                  at + first[run + 8] * chunk_row_bytes, at + first[run + 9] * chunk_row_bytes,
                  at + first[run + 10] * chunk_row_bytes, at + first[run + 11] * chunk_row_bytes,
                  at + first[run + 12] * chunk_row_bytes, at + first[run + 13] * chunk_row_bytes,
                  at + first[run + 14] * chunk_row_bytes, at + first[run + 15] * chunk_row_bytes)
        if scatter:
            copy_wide(caches, chunks, length[run] * row_bytes, wide == 2)
        else:
            if ahead:
                prefetch_rows(base, offset, run + ahead, _GROUP)
            copy_wide(chunks, caches, length[run] * row_bytes, wide == 2)
        return
    for quad in range(run, min(run + per_item, first.shape[0]), 4):
        _copy_quad(plane, quad, bases, chunk, num_tokens, row_bytes, chunk_row_bytes, first, offset, length, scatter,
                   streaming, ahead)


@njit(nogil=True, cache=True, inline="always")
def _same_lengths(length: Any, run: int) -> bool:
    for each in range(run + 1, run + _GROUP):  # noqa: SIM110 - numba compiles this loop, not a generator
        if length[each] != length[run]:
            return False
    return True


@njit(nogil=True, cache=True, inline="always")
def _copy_quad(plane: int, run: int, bases: Any, chunk: int, num_tokens: int, row_bytes: int, chunk_row_bytes: int,
               first: Any, offset: Any, length: Any, scatter: bool, streaming: bool, ahead: int) -> None:
    """Runs ``run .. run + 3`` of one (plane, layer): in lockstep when they are as long, else one by one."""
    base = bases[plane]
    rows = plane * num_tokens
    # Lockstep pays for streaming stores and for short runs (scattered rows); long runs into the
    # cache copy best one by one, through libc's memcpy.
    if (run + 3 < first.shape[0] and (streaming or length[run] * row_bytes <= _LOCKSTEP_MAX_BYTES)
            and length[run] == length[run + 1] == length[run + 2] == length[run + 3]):
        caches = (base + offset[run], base + offset[run + 1], base + offset[run + 2], base + offset[run + 3])
        chunks = (chunk + (rows + first[run]) * chunk_row_bytes, chunk + (rows + first[run + 1]) * chunk_row_bytes,
                  chunk + (rows + first[run + 2]) * chunk_row_bytes, chunk + (rows + first[run + 3]) * chunk_row_bytes)
        if scatter:
            copy_pieces(caches, chunks, length[run] * row_bytes, streaming)
        else:
            if ahead:
                prefetch_rows(base, offset, run + ahead, 4)
            copy_pieces(chunks, caches, length[run] * row_bytes, streaming)
        return
    for each in range(run, min(run + 4, first.shape[0])):
        cache_at = base + offset[each]
        chunk_at = chunk + (rows + first[each]) * chunk_row_bytes
        if scatter:
            copy_piece(cache_at, chunk_at, length[each] * row_bytes, streaming)
        else:
            copy_piece(chunk_at, cache_at, length[each] * row_bytes, streaming)


@njit(nogil=True, cache=True, inline="always")
def _copy_heads(item: int, bases: Any, chunk: int, num_tokens: int, chunk_row_bytes: int, offset: Any, units: int,
                unit_bytes: int, unit_stride: int, element_bytes: int, element_stride: int, scatter: bool) -> None:
    """One token of one (plane, layer) whose row is ``units`` strided pieces in the cache (HND).

    A piece whose elements are not contiguous (a transposed page) moves element by element.
    """
    plane = item // num_tokens
    token = item - plane * num_tokens
    cache_at = bases[plane] + offset[token]
    chunk_at = chunk + (plane * num_tokens + token) * chunk_row_bytes
    if element_stride == element_bytes:
        for unit in range(units):
            if scatter:
                copy_piece(cache_at + unit * unit_stride, chunk_at + unit * unit_bytes, unit_bytes, False)
            else:
                copy_piece(chunk_at + unit * unit_bytes, cache_at + unit * unit_stride, unit_bytes, False)
        return
    elements = unit_bytes // element_bytes
    for unit in range(units):
        cache_unit = cache_at + unit * unit_stride
        chunk_unit = chunk_at + unit * unit_bytes
        for element in range(elements):
            if scatter:
                move_element(cache_unit + element * element_stride, chunk_unit + element * element_bytes,
                              element_bytes)
            else:
                move_element(chunk_unit + element * element_bytes, cache_unit + element * element_stride,
                              element_bytes)


@njit(nogil=True, cache=True)
def _copy_tokens_serial(bases: Any, chunk: int, num_tokens: int, row_bytes: int, chunk_row_bytes: int, first: Any,
                        offset: Any, length: Any, units: int, unit_bytes: int, unit_stride: int, element_bytes: int,
                        element_stride: int, scatter: bool, streaming: bool, wide: int, ahead: int) -> None:
    if units == 1 and element_stride == element_bytes:
        per_item = _GROUP if wide else 4
        for item in range(bases.shape[0] * ((first.shape[0] + per_item - 1) // per_item)):
            _copy_group(item, bases, chunk, num_tokens, row_bytes, chunk_row_bytes, first, offset, length, scatter,
                        streaming, wide, ahead)
    else:
        for item in range(bases.shape[0] * num_tokens):
            _copy_heads(item, bases, chunk, num_tokens, chunk_row_bytes, offset, units, unit_bytes, unit_stride,
                        element_bytes, element_stride, scatter)


@njit(nogil=True, cache=True, parallel=True)
def _copy_tokens_parallel(bases: Any, chunk: int, num_tokens: int, row_bytes: int, chunk_row_bytes: int, first: Any,
                          offset: Any, length: Any, units: int, unit_bytes: int, unit_stride: int, element_bytes: int,
                          element_stride: int, scatter: bool, streaming: bool, wide: int, ahead: int) -> None:
    if units == 1 and element_stride == element_bytes:
        per_item = _GROUP if wide else 4
        for item in prange(bases.shape[0] * ((first.shape[0] + per_item - 1) // per_item)):
            _copy_group(item, bases, chunk, num_tokens, row_bytes, chunk_row_bytes, first, offset, length, scatter,
                        streaming, wide, ahead)
    else:
        for item in prange(bases.shape[0] * num_tokens):
            _copy_heads(item, bases, chunk, num_tokens, chunk_row_bytes, offset, units, unit_bytes, unit_stride,
                        element_bytes, element_stride, scatter)


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
    """The copies of one token-indexed group through :func:`_copy_tokens_serial` / ``_parallel``.

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
        if call.cpu_slots is None or not call.num_tokens:
            return
        num_bytes = chunk.numel() * chunk.element_size()
        slots = call.cpu_slots.numpy()
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
        # Tokens merge into one run only when a row is one piece in the cache and in the chunk.
        first, offset, length = _token_runs(slots, self.block_size, table.block_stride, table.offset_stride,
                                            table.row_bytes, table.rows_contiguous and table.chunk_rows_contiguous)
        # Stores that bypass the cache pay off where the written rows are not read soon: the caches
        # (unpack), and chunks too large to stay cached (pack). They need 32-byte aligned rows.
        streaming = ((scatter or num_bytes >= STREAMING_MIN_BYTES) and table.rows_contiguous
                     and (cache_alignment if scatter else chunk_at) % VECTOR_BYTES == 0
                     and table.row_bytes % VECTOR_BYTES == 0 and table.chunk_row_bytes % VECTOR_BYTES == 0)
        # Scattered rows move WIDE_ROWS at a time, a cache line each: streaming stores need 64-byte rows.
        wide_streaming = streaming and (cache_alignment if scatter else chunk_at) % WIDE_VECTOR_BYTES == 0 and (
            table.row_bytes % WIDE_VECTOR_BYTES == 0 and table.chunk_row_bytes % WIDE_VECTOR_BYTES == 0)
        short = bool(length.size) and int(length.max()) * table.row_bytes <= _LOCKSTEP_MAX_BYTES
        lockstep = 0 if not (wide and short) or (streaming and not wide_streaming) else 2 if wide_streaming else 1
        arguments = (bases, chunk_at, slots.shape[0], table.row_bytes, table.chunk_row_bytes, first, offset, length,
                     table.units, table.unit_bytes, table.unit_stride, table.element_bytes, table.element_stride,
                     scatter, streaming, lockstep, ahead if short and not scatter else 0)
        if parallel:
            with parallel_region():
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
                _copy_tokens_parallel(*arguments)
        else:
            _copy_tokens_serial(*arguments)

    @property
    def scattered_rows(self) -> bool:
        """Whether this group's rows can move in lockstep when scattered (one short piece per token)."""
        table = self.tables[0]
        return table.units == 1 and table.elements_contiguous and table.row_bytes <= _LOCKSTEP_MAX_BYTES


class NumbaStateCopier:
    """The copies of one recurrent group through :func:`_copy_states`, by state slot."""

    def __init__(self, table: StateTable) -> None:
        self.table = table
        self.arrays = tuple(tensor.numpy() for tensor in (table.bases, table.slot_strides, table.unit_bytes,
                                                          table.columns, table.layers))

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.state_indices is None or not call.num_states:
            return
        check_still_bound(self.table)
        _copy_states(*self.arrays, chunk.data_ptr(), self.table.row_bytes, call.state_indices.numpy(), scatter)


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
    first, offset, length = _token_runs(slots, 2, 64, 32, 32, True)
    for streaming in (False, STREAMING_STORES):
        _copy_tokens_serial(bases, target.ctypes.data, 2, 32, 32, first, offset, length, 1, 32, 32, 4, 4, False,
                            streaming, 2 if streaming else 1, 1)
        with parallel_region():
            _copy_tokens_parallel(bases, target.ctypes.data, 2, 32, 32, first, offset, length, 1, 32, 32, 4, 4,
                                  False, streaming, 2 if streaming else 1, 1)
    if not np.array_equal(source, target):
        raise RuntimeError("the numba copy kernel failed its warm-up copy")
    one = np.zeros(1, dtype=np.int64)
    _copy_states(bases, np.array([32], dtype=np.int64), np.array([32], dtype=np.int64), one, one, target.ctypes.data,
                 32, one, False)

