"""The CPU kernel: every (plane, layer, token run) of a group copied with memcpy in one compiled call.

Built with numba (``njit(nogil=True, cache=True)``) over the raw addresses of an
:mod:`~kvgroups.datapath.address_tables` table. A call first merges the slots into runs whose
bytes are contiguous in the cache (a whole block, or more where blocks follow each other), then
copies the runs of every (plane, layer) four at a time in lockstep, so that a gather of scattered
rows keeps several memory accesses in flight: one Python call for all layers, whatever the dtype
(the copy is of bytes, fp8 included). Unpack, and pack into large chunks, write with stores that
bypass the cache (on x86; the written rows are not read again soon, and a write that misses the
cache otherwise reads the line first). Large calls run on several threads; small ones stay on
one, because a parallel region on a machine whose other cores are busy stalls far longer than a
small copy takes.

Importing this module imports numba; the data path does so only when the kernel is chosen.
"""

from __future__ import annotations

import math
import platform
import threading
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvgroups.datapath.address_tables import StateTable, TokenTable
from kvgroups.datapath.slots import CallSlots
from kvgroups.errors import KVGroupsError
from kvgroups.sizes import MIB

# Below this many bytes a call runs on one thread (see the module docstring).
PARALLEL_MIN_BYTES = 4 * MIB
# From this many bytes on, pack writes its chunk with stores that bypass the cache (unpack always does).
STREAMING_MIN_BYTES = 4 * MIB
# numba's default threading layer (workqueue) must not run two parallel regions at once.
_PARALLEL_LOCK = threading.Lock()


# x86 stores that bypass the cache (and the fence that orders them); elsewhere plain vector stores.
_STREAMING_STORES = platform.machine().lower() in ("x86_64", "amd64")
_VECTOR_BYTES = 32  # one AVX register
_LOCKSTEP_MAX_BYTES = 8192  # runs up to this long are copied four at a time


def _row_copier(rows: int, streaming: bool) -> Any:
    """An intrinsic copying ``rows`` runs of the same length at once, 32 bytes of each in turn.

    Copying several runs in lockstep keeps several cache misses in flight, which is what a
    gather of scattered token rows is bound by. ``streaming`` stores bypass the cache (the
    destination is written once and not read soon) and need 32-byte aligned destinations and
    lengths; the caller checks that before choosing them.
    """

    @intrinsic
    def copy_rows(typingctx: Any, destinations: Any, sources: Any, num_bytes: Any) -> Any:
        signature = types.void(types.UniTuple(types.int64, rows), types.UniTuple(types.int64, rows), types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            targets, origins, count = args
            word = ir.IntType(64)
            vector = ir.VectorType(word, _VECTOR_BYTES // 8).as_pointer()
            target = [builder.extract_value(targets, row) for row in range(rows)]
            origin = [builder.extract_value(origins, row) for row in range(rows)]
            steps = builder.udiv(count, ir.Constant(word, _VECTOR_BYTES))
            with cgutils.for_range(builder, steps) as loop:
                offset = builder.mul(loop.index, ir.Constant(word, _VECTOR_BYTES))
                values = [builder.load(builder.inttoptr(builder.add(at, offset), vector), align=1) for at in origin]
                for at, value in zip(target, values, strict=True):
                    store = builder.store(value, builder.inttoptr(builder.add(at, offset), vector),
                                          align=_VECTOR_BYTES if streaming else 1)
                    if streaming:
                        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            done = builder.mul(steps, ir.Constant(word, _VECTOR_BYTES))
            rest = builder.sub(count, done)
            for at, source in zip(target, origin, strict=True):
                cgutils.raw_memcpy(
                    builder, builder.inttoptr(builder.add(at, done), cgutils.voidptr_t),
                    builder.inttoptr(builder.add(source, done), cgutils.voidptr_t), rest,
                    context.get_constant(types.intp, 1),
                )
            if streaming:
                fence = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                       "llvm.x86.sse.sfence")
                builder.call(fence, [])
            return context.get_dummy_value()

        return signature, codegen

    return copy_rows


_copy_4 = _row_copier(4, streaming=False)
_stream_1 = _row_copier(1, streaming=_STREAMING_STORES)
_stream_4 = _row_copier(4, streaming=_STREAMING_STORES)


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
def _copy_pieces(targets: Any, sources: Any, num_bytes: int, streaming: bool) -> None:
    if streaming:
        _stream_4(targets, sources, num_bytes)
    else:
        _copy_4(targets, sources, num_bytes)


@intrinsic
def _memcpy(typingctx: Any, destination: Any, source: Any, num_bytes: Any) -> Any:
    """libc's memcpy between two raw addresses given as int64 (through LLVM's memcpy intrinsic)."""
    signature = types.void(types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        target, origin, count = args
        cgutils.raw_memcpy(
            builder, builder.inttoptr(target, cgutils.voidptr_t), builder.inttoptr(origin, cgutils.voidptr_t),
            count, context.get_constant(types.intp, 1),
        )
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, cache=True, inline="always")
def _copy_piece(target: int, source: int, num_bytes: int, streaming: bool) -> None:
    if streaming:
        _stream_1((target,), (source,), num_bytes)
    else:
        _memcpy(target, source, num_bytes)


@njit(nogil=True, cache=True, inline="always")
def _copy_quad(item: int, bases: Any, chunk: int, num_tokens: int, row_bytes: int, first: Any, offset: Any,
               length: Any, scatter: bool, streaming: bool) -> None:
    """Runs ``4q .. 4q + 3`` of one (plane, layer): in lockstep when they are as long, else one by one."""
    quads = (first.shape[0] + 3) // 4
    plane = item // quads
    run = (item - plane * quads) * 4
    base = bases[plane]
    rows = plane * num_tokens
    # Lockstep pays for streaming stores and for short runs (scattered rows); long runs into the
    # cache copy best one by one, through libc's memcpy.
    if (run + 3 < first.shape[0] and (streaming or length[run] * row_bytes <= _LOCKSTEP_MAX_BYTES)
            and length[run] == length[run + 1] == length[run + 2] == length[run + 3]):
        caches = (base + offset[run], base + offset[run + 1], base + offset[run + 2], base + offset[run + 3])
        chunks = (chunk + (rows + first[run]) * row_bytes, chunk + (rows + first[run + 1]) * row_bytes,
                  chunk + (rows + first[run + 2]) * row_bytes, chunk + (rows + first[run + 3]) * row_bytes)
        if scatter:
            _copy_pieces(caches, chunks, length[run] * row_bytes, streaming)
        else:
            _copy_pieces(chunks, caches, length[run] * row_bytes, streaming)
        return
    for each in range(run, min(run + 4, first.shape[0])):
        cache_at = base + offset[each]
        chunk_at = chunk + (rows + first[each]) * row_bytes
        if scatter:
            _copy_piece(cache_at, chunk_at, length[each] * row_bytes, streaming)
        else:
            _copy_piece(chunk_at, cache_at, length[each] * row_bytes, streaming)


@njit(nogil=True, cache=True, inline="always")
def _copy_heads(item: int, bases: Any, chunk: int, num_tokens: int, row_bytes: int, offset: Any, units: int,
                unit_bytes: int, unit_stride: int, scatter: bool) -> None:
    """One token of one (plane, layer) whose row is ``units`` strided pieces in the cache (HND)."""
    plane = item // num_tokens
    token = item - plane * num_tokens
    cache_at = bases[plane] + offset[token]
    chunk_at = chunk + (plane * num_tokens + token) * row_bytes
    for unit in range(units):
        if scatter:
            _copy_piece(cache_at + unit * unit_stride, chunk_at + unit * unit_bytes, unit_bytes, False)
        else:
            _copy_piece(chunk_at + unit * unit_bytes, cache_at + unit * unit_stride, unit_bytes, False)


@njit(nogil=True, cache=True)
def _copy_tokens_serial(bases: Any, chunk: int, num_tokens: int, row_bytes: int, first: Any, offset: Any,
                        length: Any, units: int, unit_bytes: int, unit_stride: int, scatter: bool,
                        streaming: bool) -> None:
    if units == 1:
        for item in range(bases.shape[0] * ((first.shape[0] + 3) // 4)):
            _copy_quad(item, bases, chunk, num_tokens, row_bytes, first, offset, length, scatter, streaming)
    else:
        for item in range(bases.shape[0] * num_tokens):
            _copy_heads(item, bases, chunk, num_tokens, row_bytes, offset, units, unit_bytes, unit_stride, scatter)


@njit(nogil=True, cache=True, parallel=True)
def _copy_tokens_parallel(bases: Any, chunk: int, num_tokens: int, row_bytes: int, first: Any, offset: Any,
                          length: Any, units: int, unit_bytes: int, unit_stride: int, scatter: bool,
                          streaming: bool) -> None:
    if units == 1:
        for item in prange(bases.shape[0] * ((first.shape[0] + 3) // 4)):
            _copy_quad(item, bases, chunk, num_tokens, row_bytes, first, offset, length, scatter, streaming)
    else:
        for item in prange(bases.shape[0] * num_tokens):
            _copy_heads(item, bases, chunk, num_tokens, row_bytes, offset, units, unit_bytes, unit_stride, scatter)


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
            _copy_piece(cache_at, chunk_at, unit_bytes[entry], False)
        else:
            _copy_piece(chunk_at, cache_at, unit_bytes[entry], False)


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
        # What every cache-side row address is a multiple of (bases and the strides between rows).
        self.cache_alignment = math.gcd(table.block_stride, table.offset_stride, *(int(base) for base in self.bases))

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.cpu_slots is None or not call.num_tokens:
            return
        table = self.table
        _check_moved(table)
        first, offset, length = _token_runs(
            call.cpu_slots.numpy(), self.block_size, table.block_stride, table.offset_stride, table.row_bytes,
            self.merge,
        )
        num_bytes = chunk.numel() * chunk.element_size()
        # Stores that bypass the cache pay off where the written rows are not read soon: the caches
        # (unpack), and chunks too large to stay cached (pack). They need 32-byte aligned rows.
        streaming = ((scatter or num_bytes >= STREAMING_MIN_BYTES) and table.units == 1
                     and (self.cache_alignment if scatter else chunk.data_ptr()) % _VECTOR_BYTES == 0
                     and table.row_bytes % _VECTOR_BYTES == 0)
        arguments = (self.bases, chunk.data_ptr(), call.num_tokens, table.row_bytes, first, offset, length,
                     table.units, table.unit_bytes, table.unit_stride, scatter, streaming)
        threads = self.num_threads or torch.get_num_threads()
        if threads > 1 and num_bytes >= PARALLEL_MIN_BYTES:
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
    for streaming in (False, _STREAMING_STORES):
        _copy_tokens_serial(bases, target.ctypes.data, 2, 32, first, offset, length, 1, 32, 32, False, streaming)
        with _PARALLEL_LOCK:
            _copy_tokens_parallel(bases, target.ctypes.data, 2, 32, first, offset, length, 1, 32, 32, False,
                                  streaming)
    if not np.array_equal(source, target):
        raise RuntimeError("the numba copy kernel failed its warm-up copy")
    one = np.zeros(1, dtype=np.int64)
    _copy_states(bases, np.array([32], dtype=np.int64), np.array([32], dtype=np.int64), one, one, target.ctypes.data,
                 32, one, False)

