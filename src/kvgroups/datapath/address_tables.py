"""Address tables: where every byte a group's copies touch sits, read once from the bound tensors.

A token group's table lists the base address of each (K/V plane, layer) in chunk order and the
byte strides that locate a token inside a plane (one table per run of planes located alike); a
recurrent group's table lists each (layer, state tensor) with its slot stride and where its bytes
go in a chunk row. The kernels that copy from a table (numba on the CPU, Triton on CUDA) trust
it; everything they are handed was checked when the caches were bound and when the call's slots
were. A table holds the tensors it points into, so they stay alive while it is used, and
:meth:`still_valid` tells when one was moved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgroups.core.group_keys import Tensors, kv_planes
from kvgroups.core.layouts import KVLayout, to_token_major
from kvgroups.errors import KVGroupsError

# Types a copy may reinterpret bytes as, widest first.
_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8)


def widest_word(*byte_quantities: int, max_bytes: int = 16) -> torch.dtype:
    """The widest type of at most ``max_bytes`` whose size divides every quantity (row sizes,
    strides, addresses in bytes): copies then move that many bytes per element."""
    for dtype in _WORDS:
        if dtype.itemsize <= max_bytes and all(quantity % dtype.itemsize == 0 for quantity in byte_quantities):
            return dtype
    return torch.int8  # pragma: no cover - int8 divides everything


def _same_memory(tensors: tuple[torch.Tensor, ...], pointers: tuple[int, ...]) -> bool:
    return tuple(map(_data_ptr, tensors)) == pointers  # one C-level pass: every call of every copy checks it


_data_ptr = torch.Tensor.data_ptr


def check_still_bound(table: TokenTable | StateTable | AmxTable) -> None:
    """Raise when a tensor the table addresses was reallocated since the table was built."""
    if not table.still_valid():
        raise KVGroupsError(
            "a bound cache tensor was reallocated (resize_ or set_) after KVTransfer was built; bind again"
        )


@dataclass(frozen=True, eq=False)
class TokenTable:
    """Byte addresses of planes ``first_plane ..`` of a token group: plane ``p`` of layer ``l`` at
    ``bases[(p - first_plane) * num_layers + l]``.

    Token ``(block, offset)`` of a plane starts ``block * block_stride + offset * offset_stride``
    bytes after its base. In the cache a token's row is ``units`` pieces of ``unit_bytes``,
    ``unit_stride`` bytes apart (one piece in NHD layouts, one per head in HND); a piece's
    elements of ``element_bytes`` are ``element_stride`` bytes apart (contiguous unless the
    layout transposes a page, as vLLM's CPU pages do for K). In a chunk a token's row is one
    contiguous run of ``row_bytes``, ``chunk_row_bytes`` after the previous token's and
    ``chunk_column`` bytes into the chunk's row: the two differ from ``row_bytes`` and 0 only in
    a group whose values have a head size of their own, whose chunk rows hold keys, then values.
    """

    tensors: tuple[torch.Tensor, ...]  # every tensor addressed, kept alive
    pointers: tuple[int, ...]  # their data_ptr() when the table was built
    bases: torch.Tensor  # int64 [num_planes * num_layers], on the CPU
    first_plane: int
    num_planes: int
    num_layers: int
    block_stride: int
    offset_stride: int
    row_bytes: int
    units: int
    unit_bytes: int
    unit_stride: int
    element_bytes: int
    element_stride: int
    chunk_row_bytes: int
    chunk_column: int = 0

    @property
    def chunk_rows_contiguous(self) -> bool:
        """Whether consecutive tokens' rows follow each other in a chunk (so runs of them move as one)."""
        return self.chunk_row_bytes == self.row_bytes

    @property
    def elements_contiguous(self) -> bool:
        return self.element_stride == self.element_bytes

    @property
    def rows_contiguous(self) -> bool:
        """Whether a token's row is one contiguous piece in the cache."""
        return self.units == 1 and self.elements_contiguous

    def still_valid(self) -> bool:
        """Whether every addressed tensor still has the memory it had (no ``resize_`` / ``set_`` since)."""
        return _same_memory(self.tensors, self.pointers)

    def chunk_offset(self, num_tokens: int) -> int:
        """Bytes into a chunk of ``num_tokens`` tokens where this table's first plane starts."""
        return self.first_plane * self.num_layers * num_tokens * self.chunk_row_bytes + self.chunk_column


@dataclass(frozen=True, eq=False)
class StateTable:
    """Byte addresses of a recurrent group: one entry per (layer, state tensor), layer-major.

    Slot ``i`` of entry ``e`` is ``unit_bytes[e]`` contiguous bytes at ``bases[e] + i *
    slot_strides[e]``; in a chunk row of ``row_bytes`` (one layer's states of one sequence) they
    start at ``columns[e]``, in the row of layer ``layers[e]``.
    """

    tensors: tuple[torch.Tensor, ...]
    pointers: tuple[int, ...]
    bases: torch.Tensor  # int64 [entries]
    slot_strides: torch.Tensor
    unit_bytes: torch.Tensor
    columns: torch.Tensor
    layers: torch.Tensor
    num_layers: int
    row_bytes: int

    def still_valid(self) -> bool:
        return _same_memory(self.tensors, self.pointers)


def token_tables(layout: KVLayout, layers: Sequence[Tensors],
                 value_head_size: int | None = None) -> tuple[TokenTable, ...] | None:
    """The tables of a token group's layer tensors (one per run of planes located alike), or None.

    Planes whose tokens sit alike (NHD and HND layouts: all of them) share one table; a layout
    whose K and V pages differ (``VLLM_CPU``), or values of a head size of their own, get one
    per plane. None when the layers' tensors differ in strides (each plane must be located the
    same way in every layer). A pair's V tensors may differ from its K tensors in their last axis.
    None too for ``VLLM_CPU_AMX`` pages, where a token's row is not evenly spaced pieces.
    """
    if layout is KVLayout.VLLM_CPU_AMX:
        return None
    planes = [kv_planes(layout, tensors) for tensors in layers]
    for position in range(len(planes[0])):
        strides = planes[0][position][0].stride()
        if any(layer[position][0].stride() != strides for layer in planes):
            return None
    views = [[to_token_major(layout, tensor, plane, value_head_size) for tensor, plane in layer] for layer in planes]
    tensors = tuple({id(tensor): tensor for layer in planes for tensor, _ in layer}.values())
    if value_head_size is not None:
        # Chunk rows hold a token's keys, then its values: one table per plane, each with its column.
        key_row = views[0][0].shape[2] * views[0][0].shape[3] * views[0][0].element_size()
        row = key_row + views[0][1].shape[2] * views[0][1].shape[3] * views[0][1].element_size()
        return tuple(_plane_table(tensors, [layer[plane:plane + 1] for layer in views], 0, row, column)
                     for plane, column in ((0, 0), (1, key_row)))
    tables: list[TokenTable] = []
    first = 0
    for plane in range(1, len(planes[0]) + 1):
        if plane == len(planes[0]) or views[0][plane].stride() != views[0][first].stride():
            tables.append(_plane_table(tensors, [layer[first:plane] for layer in views], first))
            first = plane
    return tuple(tables)


def _plane_table(tensors: tuple[torch.Tensor, ...], views: list[list[torch.Tensor]], first_plane: int,
                 chunk_row_bytes: int | None = None, chunk_column: int = 0) -> TokenTable:
    """The table of planes ``first_plane ..`` whose token-major ``views`` (per layer) share strides.

    ``chunk_row_bytes`` None: a chunk row is this table's row (planes of one head size)."""
    _, _, num_heads, head_size = views[0][0].shape
    block_stride, offset_stride, head_stride, element_stride = views[0][0].stride()
    item = views[0][0].element_size()
    if head_size == 1:
        element_stride = 1
    rows_contiguous = element_stride == 1 and (head_stride == head_size or num_heads == 1)
    num_planes = len(views[0])
    # Chunk order: plane-major, then layer (a chunk is [kv_size, num_layers, tokens, hidden]).
    bases = [int(views[layer][plane].data_ptr()) for plane in range(num_planes) for layer in range(len(views))]
    row_bytes = num_heads * head_size * item
    return TokenTable(
        tensors=tensors, pointers=tuple(tensor.data_ptr() for tensor in tensors),
        bases=torch.tensor(bases, dtype=torch.int64), first_plane=first_plane, num_planes=num_planes,
        num_layers=len(views), block_stride=block_stride * item, offset_stride=offset_stride * item,
        row_bytes=row_bytes, chunk_row_bytes=row_bytes if chunk_row_bytes is None else chunk_row_bytes,
        chunk_column=chunk_column,
        units=1 if rows_contiguous else num_heads,
        unit_bytes=(num_heads if rows_contiguous else 1) * head_size * item,
        unit_stride=head_stride * item, element_bytes=item, element_stride=element_stride * item,
    )


def _slot_contiguous(state: torch.Tensor) -> bool:
    """Whether each slot ``state[i]`` is one contiguous run (the slot axis itself may be strided)."""
    expected = 1
    for size, stride in zip(reversed(state.shape[1:]), reversed(state.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def state_table(layers: Sequence[Tensors]) -> StateTable | None:
    """The table of a recurrent group's state tensors, or None when a slot is not one contiguous run."""
    bases, strides, sizes, columns, owners = [], [], [], [], []
    row_bytes = 0
    for layer, states in enumerate(layers):
        column = 0
        for state in states:
            if not _slot_contiguous(state):
                return None
            item = state.element_size()
            bases.append(int(state.data_ptr()))
            strides.append(int(state.stride(0)) * item)
            sizes.append(math.prod(state.shape[1:]) * item)
            columns.append(column)
            owners.append(layer)
            column += sizes[-1]
        row_bytes = column
    tensors = tuple({id(state): state for states in layers for state in states}.values())

    def as_table(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return StateTable(
        tensors=tensors, pointers=tuple(tensor.data_ptr() for tensor in tensors),
        bases=as_table(bases), slot_strides=as_table(strides), unit_bytes=as_table(sizes),
        columns=as_table(columns), layers=as_table(owners), num_layers=len(layers), row_bytes=row_bytes,
    )


@dataclass(frozen=True, eq=False)
class AmxTable:
    """Byte addresses of a group's pages as vLLM's amx kernels pack them (``VLLM_CPU_AMX``).

    Page (block, head) of layer ``l`` starts ``block * block_stride + head * head_stride`` bytes
    after ``bases[l]``: its keys, then its values, ``block_size * head_size`` elements each, in
    the order :mod:`kvgroups.core.cpu_pages` spells out.
    """

    tensors: tuple[torch.Tensor, ...]
    pointers: tuple[int, ...]
    bases: torch.Tensor  # int64 [num_layers], on the CPU
    block_stride: int
    head_stride: int
    num_heads: int
    block_size: int
    head_size: int
    element_bytes: int

    def still_valid(self) -> bool:
        return _same_memory(self.tensors, self.pointers)


def amx_table(layers: Sequence[Tensors]) -> AmxTable | None:
    """The table of a ``VLLM_CPU_AMX`` group's layer tensors, or None when the layers differ in strides."""
    tensors = tuple(layer[0] for layer in layers)
    first = tensors[0]
    if any(tensor.stride() != first.stride() for tensor in tensors):
        return None
    _, num_heads, block_size, width = first.shape
    item = first.element_size()
    return AmxTable(
        tensors=tensors, pointers=tuple(tensor.data_ptr() for tensor in tensors),
        bases=torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.int64),
        block_stride=first.stride(0) * item, head_stride=first.stride(1) * item, num_heads=num_heads,
        block_size=block_size, head_size=width // 2, element_bytes=item,
    )
