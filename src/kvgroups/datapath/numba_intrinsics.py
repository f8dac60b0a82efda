"""Raw-memory moves for the numba kernel: LLVM intrinsics over addresses given as int64.

Vector copies of several runs in lockstep (optionally with stores that bypass the cache), libc's
memcpy, and single elements of 1 to 8 bytes. Everything here trusts its addresses; the kernel in
:mod:`kvgroups.datapath.numba_copy` computes them from checked address tables.
"""

from __future__ import annotations

import platform
from typing import Any

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# x86 stores that bypass the cache (and the fence that orders them); elsewhere plain vector stores.
STREAMING_STORES = platform.machine().lower() in ("x86_64", "amd64")
VECTOR_BYTES = 32  # one AVX register
WIDE_VECTOR_BYTES = 64  # a cache line: one AVX-512 register (two AVX ones where there is no AVX-512)
WIDE_ROWS = 16  # scattered rows copied in lockstep
# How much of each scattered row a gather asks for ahead. On the AMD EPYC VM, in a hand-written loop
# like the kernel's (16 rows of 2 KiB in lockstep, the next 16 asked for), the first 512 bytes of each
# row moved 0.77-0.96 of copy_'s speed where its first line moved 0.76-0.91 and all of it 0.62 (too many
# requests in flight crowd out the rows being copied); in the kernel 512 bytes gained 0-3% over a line.
AHEAD_ROW_BYTES = 512
# How far ahead in its run a copy of long runs asks for the source bytes it copies next: the hardware's
# prefetchers stop at every 4 KiB page. Block-aligned 256-token packs of 32 KiB runs on the AMD VM, in
# one process against the kernel without it: 1.10-1.13x as fast when copy_ ran at 39-40 GB/s, 0.98-1.00x
# at 24 GB/s (unpacks 1.03-1.11x and 0.95-0.98x); in a hand-written loop 1 and 2 KiB gained alike, 4 KiB
# less.
AHEAD_RUN_BYTES = 2048


def _row_copier(rows: int, streaming: bool, vector_bytes: int = VECTOR_BYTES, ahead_bytes: int = 0) -> Any:
    """An intrinsic copying ``rows`` runs of the same length at once, ``vector_bytes`` of each in turn.

    Copying several runs in lockstep keeps several cache misses (and page walks) in flight, which
    is what a gather of scattered token rows is bound by. ``streaming`` stores bypass the cache
    (the destination is written once and not read soon) and need ``vector_bytes``-aligned
    destinations and lengths; the caller checks that before choosing them. With ``ahead_bytes``
    each step asks for the source bytes that far on in its run (never past the run's end): the
    hardware's prefetchers stop at every 4 KiB page, and a run of a block's 32 KiB crosses eight.
    """

    @intrinsic
    def copy_rows(typingctx: Any, destinations: Any, sources: Any, num_bytes: Any) -> Any:
        signature = types.void(types.UniTuple(types.int64, rows), types.UniTuple(types.int64, rows), types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            targets, origins, count = args
            word = ir.IntType(64)
            vector = ir.VectorType(word, vector_bytes // 8).as_pointer()
            target = [builder.extract_value(targets, row) for row in range(rows)]
            origin = [builder.extract_value(origins, row) for row in range(rows)]
            steps = builder.udiv(count, ir.Constant(word, vector_bytes))

            def step(offset: Any, ask_ahead: bool) -> None:
                if ask_ahead:
                    for at in origin:
                        _emit_prefetch(builder, builder.add(at, builder.add(offset, ir.Constant(word, ahead_bytes))))
                values = [builder.load(builder.inttoptr(builder.add(at, offset), vector), align=1) for at in origin]
                for at, value in zip(target, values, strict=True):
                    store = builder.store(value, builder.inttoptr(builder.add(at, offset), vector),
                                          align=vector_bytes if streaming else 1)
                    if streaming:
                        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))

            # The steps whose bytes ahead_bytes on still lie in the run ask for them; the rest only copy.
            lead = ir.Constant(word, ahead_bytes // vector_bytes)
            asking = builder.select(builder.icmp_unsigned(">", steps, lead), builder.sub(steps, lead),
                                    ir.Constant(word, 0)) if ahead_bytes else ir.Constant(word, 0)
            with cgutils.for_range(builder, asking) as loop:
                step(builder.mul(loop.index, ir.Constant(word, vector_bytes)), True)
            with cgutils.for_range(builder, builder.sub(steps, asking)) as loop:
                step(builder.mul(builder.add(loop.index, asking), ir.Constant(word, vector_bytes)), False)
            done = builder.mul(steps, ir.Constant(word, vector_bytes))
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


_copy_4 = _row_copier(4, streaming=False, ahead_bytes=AHEAD_RUN_BYTES)
_stream_1 = _row_copier(1, streaming=STREAMING_STORES)
_stream_4 = _row_copier(4, streaming=STREAMING_STORES, ahead_bytes=AHEAD_RUN_BYTES)


_copy_wide = _row_copier(WIDE_ROWS, streaming=False, vector_bytes=WIDE_VECTOR_BYTES)
_stream_wide = _row_copier(WIDE_ROWS, streaming=STREAMING_STORES, vector_bytes=WIDE_VECTOR_BYTES)


@njit(nogil=True, cache=True, inline="always")
def copy_pieces(targets: Any, sources: Any, num_bytes: int, streaming: bool) -> None:
    if streaming:
        _stream_4(targets, sources, num_bytes)
    else:
        _copy_4(targets, sources, num_bytes)


@njit(nogil=True, cache=True, inline="always")
def copy_wide(targets: Any, sources: Any, num_bytes: int, streaming: bool) -> None:
    """:data:`WIDE_ROWS` runs in lockstep, a cache line of each in turn (streaming: 64-byte aligned)."""
    if streaming:
        _stream_wide(targets, sources, num_bytes)
    else:
        _copy_wide(targets, sources, num_bytes)


def _emit_prefetch(builder: Any, address: Any) -> None:
    """Ask for the cache line at a raw address (an int64 value) to be read into every cache level."""
    word = ir.IntType(32)
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, word, word, word]), "llvm.prefetch.p0")
    # read (0), keep in every level (3), data (1)
    builder.call(function, [builder.inttoptr(address, cgutils.voidptr_t), ir.Constant(word, 0), ir.Constant(word, 3),
                            ir.Constant(word, 1)])


@intrinsic
def prefetch(typingctx: Any, address: Any) -> Any:
    """Ask for the cache line at a raw address (int64) to be read into every cache level; never faults."""
    signature = types.void(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        _emit_prefetch(builder, args[0])
        return context.get_dummy_value()

    return signature, codegen


@njit(nogil=True, cache=True, inline="always")
def prefetch_rows(base: int, offset: Any, length: Any, row_bytes: int, start: int, count: int) -> None:
    """The first :data:`AHEAD_ROW_BYTES` (at most) of runs ``start .. start + count - 1``, ``length[run]`` rows
    of ``row_bytes`` at ``base + offset[run]``, those that exist."""
    for run in range(start, min(start + count, offset.shape[0])):
        at = base + offset[run]
        for line in range(0, min(AHEAD_ROW_BYTES, length[run] * row_bytes), WIDE_VECTOR_BYTES):
            prefetch(at + line)


@intrinsic
def memcpy(typingctx: Any, destination: Any, source: Any, num_bytes: Any) -> Any:
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
def copy_piece(target: int, source: int, num_bytes: int, streaming: bool) -> None:
    if streaming:
        _stream_1((target,), (source,), num_bytes)
    else:
        memcpy(target, source, num_bytes)


def _element_mover(width: int) -> Any:
    """An intrinsic moving one ``width``-byte element between two raw addresses (unaligned)."""

    @intrinsic
    def move(typingctx: Any, destination: Any, source: Any) -> Any:
        signature = types.void(types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            target, origin = args
            pointer = ir.IntType(8 * width).as_pointer()
            value = builder.load(builder.inttoptr(origin, pointer), align=1)
            builder.store(value, builder.inttoptr(target, pointer), align=1)
            return context.get_dummy_value()

        return signature, codegen

    return move


_move_1, _move_2, _move_4, _move_8 = (_element_mover(width) for width in (1, 2, 4, 8))


@njit(nogil=True, cache=True, inline="always")
def move_element(target: int, source: int, width: int) -> None:
    if width == 2:
        _move_2(target, source)
    elif width == 4:
        _move_4(target, source)
    elif width == 1:
        _move_1(target, source)
    elif width == 8:
        _move_8(target, source)
    else:
        memcpy(target, source, width)

