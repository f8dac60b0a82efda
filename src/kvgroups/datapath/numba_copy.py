"""The CPU kernel: every (plane, layer, token run) of a group copied with memcpy in one compiled call.

Built with numba (``njit(nogil=True, cache=True)``) over the raw addresses of an
:mod:`~kvgroups.datapath.address_tables` table. A call first merges the slots into runs whose
bytes are contiguous in the cache (a whole block, or more where blocks follow each other), then
copies each run of each (plane, layer) with one memcpy: one Python call for all layers, whatever
the dtype (the copy is of bytes, fp8 included). Large calls run on several threads; small ones
stay on one, because a parallel region on a machine whose other cores are busy stalls far longer
than a small copy takes.

Importing this module imports numba; the data path does so only when the kernel is chosen.
"""

from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgroups.datapath.address_tables import StateTable, TokenTable
from kvgroups.datapath.slots import CallSlots
from kvgroups.errors import KVGroupsError
from kvgroups.sizes import MIB

# Below this many bytes a call runs on one thread (see the module docstring).
PARALLEL_MIN_BYTES = 4 * MIB
# numba's default threading layer (workqueue) must not run two parallel regions at once.
_PARALLEL_LOCK = threading.Lock()


@intrinsic
def _memcpy(typingctx: Any, destination: Any, source: Any, num_bytes: Any) -> Any:
    """memcpy between two raw addresses given as int64 (LLVM's memcpy intrinsic)."""
    signature = types.void(types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        target, origin, count = args
        cgutils.raw_memcpy(
            builder, builder.inttoptr(target, cgutils.voidptr_t), builder.inttoptr(origin, cgutils.voidptr_t),
            count, context.get_constant(types.intp, 1),
        )
        return context.get_dummy_value()

    return signature, codegen


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
def _copy_run(item: int, bases: Any, chunk: int, num_tokens: int, row_bytes: int, first: Any, offset: Any,
              length: Any, units: int, unit_bytes: int, unit_stride: int, scatter: bool) -> None:
    num_runs = first.shape[0]
    plane = item // num_runs
    run = item - plane * num_runs
    cache_at = bases[plane] + offset[run]
    chunk_at = chunk + (plane * num_tokens + first[run]) * row_bytes
    if units == 1:
        if scatter:
            _memcpy(cache_at, chunk_at, length[run] * row_bytes)
        else:
            _memcpy(chunk_at, cache_at, length[run] * row_bytes)
        return
    for unit in range(units):  # runs are single tokens here: their pieces are strided in the cache
        if scatter:
            _memcpy(cache_at + unit * unit_stride, chunk_at + unit * unit_bytes, unit_bytes)
        else:
            _memcpy(chunk_at + unit * unit_bytes, cache_at + unit * unit_stride, unit_bytes)


@njit(nogil=True, cache=True)
def _copy_tokens_serial(bases: Any, chunk: int, num_tokens: int, row_bytes: int, first: Any, offset: Any,
                        length: Any, units: int, unit_bytes: int, unit_stride: int, scatter: bool) -> None:
    for item in range(bases.shape[0] * first.shape[0]):
        _copy_run(item, bases, chunk, num_tokens, row_bytes, first, offset, length, units, unit_bytes, unit_stride,
                  scatter)


@njit(nogil=True, cache=True, parallel=True)
def _copy_tokens_parallel(bases: Any, chunk: int, num_tokens: int, row_bytes: int, first: Any, offset: Any,
                          length: Any, units: int, unit_bytes: int, unit_stride: int, scatter: bool) -> None:
    for item in prange(bases.shape[0] * first.shape[0]):
        _copy_run(item, bases, chunk, num_tokens, row_bytes, first, offset, length, units, unit_bytes, unit_stride,
                  scatter)


@njit(nogil=True, cache=True, inline="always")
def _copy_state(item: int, bases: Any, slot_strides: Any, unit_bytes: Any, columns: Any, layers: Any, chunk: int,
                row_bytes: int, indices: Any, scatter: bool) -> None:
    count = indices.shape[0]
    entry = item // count
    position = item - entry * count
    cache_at = bases[entry] + indices[position] * slot_strides[entry]
    chunk_at = chunk + (layers[entry] * count + position) * row_bytes + columns[entry]
    if scatter:
        _memcpy(cache_at, chunk_at, unit_bytes[entry])
    else:
        _memcpy(chunk_at, cache_at, unit_bytes[entry])


@njit(nogil=True, cache=True)
def _copy_states(bases: Any, slot_strides: Any, unit_bytes: Any, columns: Any, layers: Any, chunk: int,
                 row_bytes: int, indices: Any, scatter: bool) -> None:
    for item in range(bases.shape[0] * indices.shape[0]):
        _copy_state(item, bases, slot_strides, unit_bytes, columns, layers, chunk, row_bytes, indices, scatter)


def _check_moved(table: TokenTable | StateTable) -> None:
    if not table.still_valid():
        raise KVGroupsError(
            "a bound cache tensor was reallocated (resize_ or set_) after KVTransfer was built; bind again"
        )


class NumbaTokenCopier:
    """The copies of one token-indexed group through :func:`_copy_tokens_serial` / ``_parallel``."""

    def __init__(self, table: TokenTable, block_size: int, num_threads: int | None) -> None:
        self.table = table
        self.block_size = block_size
        self.num_threads = num_threads
        self.bases = table.bases.numpy()
        # Tokens merge into one run only when a row is one piece in the cache.
        self.merge = table.units == 1

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.cpu_slots is None or not call.num_tokens:
            return
        table = self.table
        _check_moved(table)
        first, offset, length = _token_runs(
            call.cpu_slots.numpy(), self.block_size, table.block_stride, table.offset_stride, table.row_bytes,
            self.merge,
        )
        arguments = (self.bases, chunk.data_ptr(), call.num_tokens, table.row_bytes, first, offset, length,
                     table.units, table.unit_bytes, table.unit_stride, scatter)
        threads = self.num_threads or torch.get_num_threads()
        if threads > 1 and chunk.numel() * chunk.element_size() >= PARALLEL_MIN_BYTES:
            with _PARALLEL_LOCK:
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
                _copy_tokens_parallel(*arguments)
        else:
            _copy_tokens_serial(*arguments)


class NumbaStateCopier:
    """The copies of one recurrent group through :func:`_copy_states`, by state slot."""

    def __init__(self, table: StateTable) -> None:
        self.table = table
        self.arrays = tuple(tensor.numpy() for tensor in (table.bases, table.slot_strides, table.unit_bytes,
                                                          table.columns, table.layers))

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.state_indices is None or not call.num_states:
            return
        _check_moved(self.table)
        _copy_states(*self.arrays, chunk.data_ptr(), self.table.row_bytes, call.state_indices.numpy(), scatter)
