"""The CUDA kernel: the same address tables as the CPU kernel, copied by Triton programs.

One program per (plane, layer) and token row (or per (layer, state) and state slot) loads the
row's base address from the table, casts it to a pointer and copies the row in words of the
widest integer type that divides every address, stride and size involved, so any dtype copies
bit for bit. CUDA builds of torch ship Triton, so GPU users install nothing more. On CPU tensors
the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests run
them against the torch path.

Importing this module imports triton; the data path does so only when the kernel is chosen.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvgroups.datapath.address_tables import StateTable, TokenTable, check_still_bound, widest_word
from kvgroups.datapath.slots import CallSlots

_BLOCK = 256  # words one program copies per step
# CUDA's limit on a grid's second axis: longer token runs are launched in pieces of at most this many.
MAX_GRID_TOKENS = 65_535


def _word(*byte_quantities: int) -> torch.dtype:
    """Triton moves integers of at most 8 bytes."""
    return widest_word(*byte_quantities, max_bytes=8)


@triton.jit
def _copy_rows(bases, offsets, chunk, num_tokens, first_token, chunk_row_words, units, unit_words, unit_stride_words,
               element_words, element_stride_words, scatter: tl.constexpr, block: tl.constexpr) -> None:
    plane = tl.program_id(0)
    token = first_token + tl.program_id(1)
    address = tl.load(bases + plane) + tl.load(offsets + token)
    cache = address.to(tl.pointer_type(chunk.dtype.element_ty))
    row = chunk + (plane * num_tokens + token) * chunk_row_words
    # A row's pieces (one per head in HND layouts) are copied together, every lane busy: a head of 128
    # bf16 values is 32 words, an eighth of a block.
    row_words = units * unit_words
    for start in range(0, row_words, block):
        index = start + tl.arange(0, block)
        mask = index < row_words
        unit = index // unit_words
        within = index - unit * unit_words
        # Word `within` of a piece is word `within % element_words` of element `within // element_words`;
        # elements lie element_stride_words apart (1 and 1: contiguous words).
        spread = unit * unit_stride_words + (within // element_words) * element_stride_words + within % element_words
        if scatter:
            tl.store(cache + spread, tl.load(row + index, mask=mask), mask=mask)
        else:
            tl.store(row + index, tl.load(cache + spread, mask=mask), mask=mask)


@triton.jit
def _copy_states(bases, slot_strides, unit_words, columns, layers, indices, chunk, count, row_words,
                 scatter: tl.constexpr, block: tl.constexpr) -> None:
    entry = tl.program_id(0)
    position = tl.program_id(1)
    address = tl.load(bases + entry) + tl.load(indices + position) * tl.load(slot_strides + entry)
    cache = address.to(tl.pointer_type(chunk.dtype.element_ty))
    row = chunk + (tl.load(layers + entry) * count + position) * row_words + tl.load(columns + entry)
    size = tl.load(unit_words + entry)
    for start in range(0, size, block):
        index = start + tl.arange(0, block)
        mask = index < size
        if scatter:
            tl.store(cache + index, tl.load(row + index, mask=mask), mask=mask)
        else:
            tl.store(row + index, tl.load(cache + index, mask=mask), mask=mask)


def _chunk_words(chunk: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    return chunk.view(-1).view(torch.uint8).view(_word(word.itemsize, chunk.data_ptr()))


class TritonTokenCopier:
    """The copies of one token-indexed group through :func:`_copy_rows`, one launch per address table."""

    def __init__(self, tables: tuple[TokenTable, ...], block_size: int) -> None:
        self.tables = tables
        self.block_size = block_size
        device = tables[0].tensors[0].device
        self.bases = [table.bases.to(device) for table in tables]
        quantities = [quantity for table in tables for quantity in (
            table.row_bytes, table.chunk_row_bytes, table.chunk_column, table.unit_bytes, table.unit_stride,
            table.block_stride, table.offset_stride,
            *(int(base) for base in table.bases.tolist()),
            # Elements that are not contiguous move in words no wider than an element.
            *(() if table.elements_contiguous else (table.element_bytes, table.element_stride)),
        )]
        self.word = _word(*quantities)

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.slots is None or not call.num_tokens:
            return
        words = _chunk_words(chunk, self.word)
        size = words.element_size()
        blocks = torch.div(call.slots, self.block_size, rounding_mode="floor")
        in_block = call.slots - blocks * self.block_size
        check_still_bound(self.tables[0])  # every table of a group addresses the same tensors
        for table, bases in zip(self.tables, self.bases, strict=True):
            offsets = blocks * table.block_stride + in_block * table.offset_stride
            element_words, element_stride_words = (
                (1, 1) if table.elements_contiguous else (table.element_bytes // size, table.element_stride // size)
            )
            rows = words[table.chunk_offset(call.num_tokens) // size:]
            # Addresses and offsets are bytes; sizes and strides are words (each divides by the word size).
            for first in range(0, call.num_tokens, MAX_GRID_TOKENS):
                grid: Any = (table.num_planes * table.num_layers, min(MAX_GRID_TOKENS, call.num_tokens - first))
                _copy_rows[grid](bases, offsets, rows, call.num_tokens, first, table.chunk_row_bytes // size,
                                 table.units, table.unit_bytes // size, table.unit_stride // size, element_words,
                                 element_stride_words, scatter=scatter, block=_BLOCK)


class TritonStateCopier:
    """The copies of one recurrent group through :func:`_copy_states`, by state slot."""

    def __init__(self, table: StateTable) -> None:
        self.table = table
        device = table.tensors[0].device
        self.word = _word(table.row_bytes, *table.bases.tolist(), *table.slot_strides.tolist(),
                          *table.unit_bytes.tolist(), *table.columns.tolist())
        self.bases = table.bases.to(device)
        self.slot_strides = table.slot_strides.to(device)
        self.unit_bytes = table.unit_bytes.to(device)
        self.columns = table.columns.to(device)
        self.layers = table.layers.to(device)

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.state_indices is None or not call.num_states:
            return
        check_still_bound(self.table)
        words = _chunk_words(chunk, self.word)
        size = words.element_size()
        grid: Any = (self.bases.shape[0], call.num_states)
        _copy_states[grid](self.bases, self.slot_strides, self.unit_bytes // size, self.columns // size, self.layers,
                           call.state_indices, words, call.num_states, self.table.row_bytes // size,
                           scatter=scatter, block=_BLOCK)
