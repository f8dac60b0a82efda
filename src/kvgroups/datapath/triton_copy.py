"""The CUDA kernels: every table of a group in one launch, each copy located by a descriptor run.

A token group's launch has one program per (plane and layer of any of its tables, run, token of the
run): it reads its run from the descriptor ring (:mod:`~kvgroups.datapath.descriptors`), its
table entry (base address and strides, bound once on the device), and copies one token row in
words of the widest integer type dividing every address, stride and size involved, so any dtype
copies bit for bit. Rows that are one contiguous piece in the cache (NHD pages, MLA latents) copy
without any division; others (HND heads, vLLM's transposed CPU key pages) spread their words by
the table's unit and element strides. A recurrent group's launch has one program per (layer and
state tensor, state slot). Chunks and the ring are addressed by their byte addresses, so a chunk
in pinned host memory is read or written by the kernel itself, with no staging copy.

CUDA builds of torch ship Triton, so GPU users install nothing more. On CPU tensors the kernels run
under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests run them against the
torch path. Importing this module imports triton; the data path does so only when the kernel is chosen.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvgroups.datapath.address_tables import StateTable, TokenTable, check_still_bound, widest_word
from kvgroups.datapath.run_queue import RunCopier

_BLOCK = 256  # words one program copies per step
# CUDA's limit on a grid's second and third axes: more runs are launched in pieces of at most this many.
MAX_GRID_RUNS = 65_535
_TRITON_WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
@triton.jit
def _copy_token_runs(params, ring_address, first_run, chunk_row_bytes, word: tl.constexpr, word_bytes: tl.constexpr,
                     block_tokens: tl.constexpr, contiguous: tl.constexpr, scatter: tl.constexpr,
                     block: tl.constexpr) -> None:
    entry = params + tl.program_id(0) * 10
    run = ring_address.to(tl.pointer_type(tl.int64)) + (first_run + tl.program_id(1)) * 5
    token = tl.program_id(2)
    if token < tl.load(run + 1):
        slot = tl.load(run) + token
        page = slot // block_tokens
        address = tl.load(entry) + page * tl.load(entry + 1) + (slot - page * block_tokens) * tl.load(entry + 2)
        cache = address.to(tl.pointer_type(word))
        chunk_row = (tl.load(entry + 3) * tl.load(run + 3) + tl.load(run + 4) + token) * chunk_row_bytes
        row = (tl.load(run + 2) + chunk_row + tl.load(entry + 4)).to(tl.pointer_type(word))
        unit_words = tl.load(entry + 6) // word_bytes
        row_words = tl.load(entry + 5) * unit_words
        for start in range(0, row_words, block):
            index = start + tl.arange(0, block)
            mask = index < row_words
            if contiguous:
                spread = index
            else:
                # Word `within` of a piece is word `within % element_words` of element `within // element_words`;
                # pieces lie unit_stride apart, elements element_stride apart.
                element_words = tl.load(entry + 8) // word_bytes
                unit = index // unit_words
                within = index - unit * unit_words
                spread = (unit * (tl.load(entry + 7) // word_bytes)
                          + (within // element_words) * (tl.load(entry + 9) // word_bytes) + within % element_words)
            if scatter:
                tl.store(cache + spread, tl.load(row + index, mask=mask), mask=mask)
            else:
                tl.store(row + index, tl.load(cache + spread, mask=mask), mask=mask)


@triton.jit
def _copy_state_runs(params, ring_address, first_run, row_bytes, word: tl.constexpr, word_bytes: tl.constexpr,
                     scatter: tl.constexpr, block: tl.constexpr) -> None:
    entry = params + tl.program_id(0) * 5
    run = ring_address.to(tl.pointer_type(tl.int64)) + (first_run + tl.program_id(1)) * 5
    cache = (tl.load(entry) + tl.load(run) * tl.load(entry + 1)).to(tl.pointer_type(word))
    chunk_row = (tl.load(entry + 4) * tl.load(run + 3) + tl.load(run + 4)) * row_bytes + tl.load(entry + 3)
    row = (tl.load(run + 2) + chunk_row).to(tl.pointer_type(word))
    size = tl.load(entry + 2) // word_bytes
    for start in range(0, size, block):
        index = start + tl.arange(0, block)
        mask = index < size
        if scatter:
            tl.store(cache + index, tl.load(row + index, mask=mask), mask=mask)
        else:
            tl.store(row + index, tl.load(cache + index, mask=mask), mask=mask)


def _token_params(tables: tuple[TokenTable, ...]) -> np.ndarray:
    """Per (plane, layer) of every table, in chunk order: base, block and offset strides, the plane-layer row
    block of the chunk, the chunk column, units, unit bytes and stride, element bytes and stride."""
    rows = []
    for table in tables:
        # Contiguous elements are spread as one element a piece: words then move through a piece in order.
        element_bytes, element_stride = ((table.unit_bytes, table.unit_bytes) if table.elements_contiguous
                                         else (table.element_bytes, table.element_stride))
        for index, base in enumerate(table.bases.tolist()):
            plane_layer = table.first_plane * table.num_layers + index
            rows.append((base, table.block_stride, table.offset_stride, plane_layer, table.chunk_column, table.units,
                         table.unit_bytes, table.unit_stride, element_bytes, element_stride))
    return np.array(rows, dtype=np.int64)


class TritonTokenCopier(RunCopier):
    """The copies of one token-indexed group: every table's planes and layers in one launch of
    :func:`_copy_token_runs`."""

    def __init__(self, tables: tuple[TokenTable, ...], block_size: int) -> None:
        super().__init__(tables[0].tensors[0].device, block_size, MAX_GRID_RUNS)
        self.tables = tables
        chunk_rows = {table.chunk_row_bytes for table in tables}
        assert len(chunk_rows) == 1, "a group's tables share their chunk rows"
        self.chunk_row_bytes = chunk_rows.pop()
        self.params = torch.from_numpy(_token_params(tables)).to(self.device)
        self.contiguous = all(table.rows_contiguous for table in tables)
        self.word_bytes = widest_word(*(quantity for table in tables for quantity in (
            table.row_bytes, table.chunk_row_bytes, table.chunk_column, table.unit_bytes, table.unit_stride,
            table.block_stride, table.offset_stride, *table.bases.tolist(),
            # Elements that are not contiguous move in words no wider than an element.
            *(() if table.elements_contiguous else (table.element_bytes, table.element_stride)),
        )), max_bytes=8).itemsize

    def check_bound(self) -> None:
        check_still_bound(self.tables[0])  # every table of a group addresses the same tensors

    def launch_runs(self, first: int, count: int, longest: int, word: int, scatter: bool) -> None:
        grid = (self.params.shape[0], count, longest)
        self.launch(_copy_token_runs, grid, (self.params, self.ring.address, first, self.chunk_row_bytes),
                    {"word": _TRITON_WORDS[word], "word_bytes": word, "block_tokens": self.block_size,
                     "contiguous": self.contiguous, "scatter": scatter, "block": _BLOCK})


class TritonStateCopier(RunCopier):
    """The copies of one recurrent group, by state slot: every layer's states in one launch of
    :func:`_copy_state_runs`."""

    def __init__(self, table: StateTable) -> None:
        super().__init__(table.tensors[0].device, 0, MAX_GRID_RUNS)
        self.table = table
        columns = np.stack([table.bases.numpy(), table.slot_strides.numpy(), table.unit_bytes.numpy(),
                            table.columns.numpy(), table.layers.numpy()], axis=1)
        self.params = torch.from_numpy(np.ascontiguousarray(columns)).to(self.device)
        self.word_bytes = widest_word(table.row_bytes, *table.bases.tolist(), *table.slot_strides.tolist(),
                                      *table.unit_bytes.tolist(), *table.columns.tolist(), max_bytes=8).itemsize

    def check_bound(self) -> None:
        check_still_bound(self.table)

    def launch_runs(self, first: int, count: int, longest: int, word: int, scatter: bool) -> None:
        grid = (self.params.shape[0], count, 1)
        self.launch(_copy_state_runs, grid, (self.params, self.ring.address, first, self.table.row_bytes),
                    {"word": _TRITON_WORDS[word], "word_bytes": word, "scatter": scatter, "block": _BLOCK})
