"""The numba kernels that copy token rows between a group's caches and a chunk, over raw addresses.

``TOKEN_KERNELS[parallel, scatter]`` copies every (plane, layer, token run) of one address table
in one compiled call, on one thread or all. The direction is compiled into each kernel rather than
passed at run time: a gather of scattered rows that tested it in its loop ran 5-10% slower (the
kind of store, the width of the lockstep and the prefetch distance cost nothing measurable as
arguments, and each kernel more costs 1-3 s of compiling on a machine's first run). Runs of
scattered rows move four or sixteen at a time in lockstep; the caller says which, and how far
ahead a gather asks for rows (:mod:`~kvgroups.datapath.lockstep` measures it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from kvgroups.datapath.numba_intrinsics import (
    WIDE_ROWS,
    copy_piece,
    copy_pieces,
    copy_wide,
    move_element,
    prefetch_rows,
)

LOCKSTEP_MAX_BYTES = 8192  # runs up to this long are copied in lockstep (into the cache too)
_GROUP = WIDE_ROWS  # runs per work item


@njit(nogil=True, cache=True)
def token_runs(slots: Any, block_size: int, block_stride: int, offset_stride: int, run_bytes: int,
               merge: bool) -> Any:
    """Runs of tokens whose rows follow each other in the cache: (first token, byte offset, length), and the
    longest run's length (0 without slots)."""
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
    longest = 0
    for run in range(runs):  # here, not in the parallel kernel, where numba would make it a parallel reduction
        longest = max(longest, length[run])
    return first[:runs], offset[:runs], length[:runs], longest


@njit(nogil=True, cache=True, inline="always")
def _copy_group(item: int, bases: Any, chunk: int, num_tokens: int, row_bytes: int, chunk_row_bytes: int,
                first: Any, offset: Any, length: Any, scatter: bool, streaming: bool, wide: int, ahead: int) -> None:
    """Runs ``16g .. 16g + 15`` of one (plane, layer) where every run is short (``wide``: scattered rows),
    all in lockstep when they are as long, a cache line of each in turn (``wide`` 2: with streaming
    stores); else runs ``4g .. 4g + 3``. A gather with ``ahead`` asks first for the first bytes of the
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
                prefetch_rows(base, offset, length, row_bytes, run + ahead, _GROUP)
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
    if (run + 3 < first.shape[0] and (streaming or length[run] * row_bytes <= LOCKSTEP_MAX_BYTES)
            and length[run] == length[run + 1] == length[run + 2] == length[run + 3]):
        caches = (base + offset[run], base + offset[run + 1], base + offset[run + 2], base + offset[run + 3])
        chunks = (chunk + (rows + first[run]) * chunk_row_bytes, chunk + (rows + first[run + 1]) * chunk_row_bytes,
                  chunk + (rows + first[run + 2]) * chunk_row_bytes, chunk + (rows + first[run + 3]) * chunk_row_bytes)
        if scatter:
            copy_pieces(caches, chunks, length[run] * row_bytes, streaming)
        else:
            if ahead:
                prefetch_rows(base, offset, length, row_bytes, run + ahead, 4)
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



def _kernel(parallel: bool, scatter: bool) -> Any:
    """The kernel for one direction, on one thread or (``parallel``) all, its loop numba's ``prange``.

    It finds the slots' runs itself: every call into numba from Python costs its dispatch, and after a
    copy of tens of MiB has evicted the CPU's caches each costs 30-100 us (a 256-token chunk moves in
    0.7-1.3 ms). (numba's ``set_num_threads`` inside the kernel would save another, but a kernel that
    calls it cannot be cached: every process would compile it again.)
    """
    loop = prange if parallel else range

    def copy_tokens(bases: Any, chunk: int, slots: Any, block_size: int, block_stride: int, offset_stride: int,
                    merge: bool, row_bytes: int, chunk_row_bytes: int, units: int, unit_bytes: int, unit_stride: int,
                    element_bytes: int, element_stride: int, streaming: bool, wide: int, ahead: int) -> None:
        num_tokens = slots.shape[0]
        first, offset, length, longest = token_runs(slots, block_size, block_stride, offset_stride, row_bytes, merge)
        # Runs of scattered rows move in lockstep (wide) and a gather asks ahead only when every run is short.
        if longest == 0 or longest * row_bytes > LOCKSTEP_MAX_BYTES:
            wide, ahead = 0, 0
        if units == 1 and element_stride == element_bytes:
            items = (first.shape[0] + (_GROUP if wide else 4) - 1) // (_GROUP if wide else 4)
            for item in loop(bases.shape[0] * items):
                _copy_group(item, bases, chunk, num_tokens, row_bytes, chunk_row_bytes, first, offset, length,
                            scatter, streaming, wide, ahead)
        else:
            for item in loop(bases.shape[0] * num_tokens):
                _copy_heads(item, bases, chunk, num_tokens, chunk_row_bytes, offset, units, unit_bytes, unit_stride,
                            element_bytes, element_stride, scatter)

    return njit(nogil=True, cache=True, parallel=parallel)(copy_tokens)


# (parallel, scatter) -> its kernel; numba compiles each on its first call (or loads it from its cache).
TOKEN_KERNELS: dict[tuple[bool, bool], Any] = {
    (parallel, scatter): _kernel(parallel, scatter) for parallel in (False, True) for scatter in (False, True)
}
