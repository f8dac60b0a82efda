"""The copies of the data path: token rows and state slots between caches and chunk tensors.

A token's heads form one contiguous row in NHD layouts, and a block's tokens one contiguous run,
so each (layer, K/V plane) moves with one ``index_select`` (gather) or ``index_put_`` (scatter)
over a 2-D row view (``as_strided``) of the layer tensor's own storage. Scatters reinterpret rows
as the widest type their byte sizes allow: those kernels pay per element. Layouts whose token
rows are not contiguous (HND) use advanced indexing on a token-major view instead. Every view
aliases the caller's tensors, so writes land in the caches, permuted views included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.groups import KVLayerGroupInfo
from kvgroups.layouts import to_token_major

# Reinterpretation types for scatters, widest first.
_WIDE_TYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def widest(*byte_quantities: int) -> torch.dtype:
    """The widest type whose size divides every quantity (row sizes, strides, offsets in bytes)."""
    for dtype in _WIDE_TYPES:
        if all(quantity % dtype.itemsize == 0 for quantity in byte_quantities):
            return dtype
    return torch.uint8  # pragma: no cover - uint8 divides everything


@dataclass(frozen=True)
class TokenPlan:
    """Where a token range lives in caches of one block size (tensors on the caches' device).

    The first ``num_block_tokens`` tokens fill whole blocks ``block_ids`` (the range starts on a
    block boundary and runs through each block in order); ``blocks``/``offsets`` locate every
    token.
    """

    num_tokens: int
    num_block_tokens: int
    block_ids: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor


def plan_tokens(slots: torch.Tensor, cpu_slots: torch.Tensor, block_size: int) -> TokenPlan:
    num_tokens = cpu_slots.shape[0]
    full_blocks = num_tokens // block_size
    aligned = False
    if full_blocks:
        head = cpu_slots[: full_blocks * block_size].view(full_blocks, block_size)
        first = head[:, :1]
        aligned = bool(((first % block_size == 0) & (head - first == torch.arange(block_size))).all())
    num_block_tokens = full_blocks * block_size if aligned else 0
    return TokenPlan(
        num_tokens=num_tokens,
        num_block_tokens=num_block_tokens,
        block_ids=slots[:num_block_tokens:block_size] // block_size,
        blocks=slots // block_size,
        offsets=slots % block_size,
    )


@dataclass(frozen=True)
class RowMap:
    """Where the token rows of a layer tensor's K/V planes sit, in elements of its storage.

    Token ``(block, offset)`` of plane ``p`` starts at ``storage_offset + plane_offsets[p] +
    block * block_stride + offset * offset_stride`` and spans ``hidden`` contiguous elements.
    """

    strides: tuple[int, ...]  # the tensor strides this map was computed for (torch.Size compares equal)
    plane_offsets: tuple[int, ...]
    block_stride: int
    offset_stride: int
    hidden: int
    num_blocks: int
    block_size: int

    @property
    def num_rows(self) -> int:
        """Rows a token-row view must span to reach the last token."""
        last = (self.num_blocks - 1) * self.block_stride + (self.block_size - 1) * self.offset_stride
        return last // self.hidden + 1

    @property
    def blocks_contiguous(self) -> bool:
        return self.offset_stride == self.hidden


def row_map(group: KVLayerGroupInfo, tensor: torch.Tensor) -> RowMap | None:
    """The row map of one layer tensor of ``group``, or None when its token rows are not contiguous."""
    split = group.layout.tensors_per_layer == 2
    planes = [to_token_major(group.layout, tensor, kv) for kv in range(1 if split else group.kv_size)]
    num_blocks, block_size, num_heads, head_size = planes[0].shape
    block_stride, offset_stride, head_stride, element_stride = planes[0].stride()
    hidden = num_heads * head_size
    if (element_stride != 1 and head_size > 1) or (head_stride != head_size and num_heads > 1):
        return None
    if block_stride % hidden or offset_stride % hidden:
        return None
    base = int(tensor.storage_offset())
    return RowMap(
        strides=tuple(tensor.stride()),
        plane_offsets=tuple(int(plane.storage_offset()) - base for plane in planes),
        block_stride=block_stride, offset_stride=offset_stride, hidden=hidden,
        num_blocks=num_blocks, block_size=block_size,
    )


def _plane_tensors(group: KVLayerGroupInfo, value: Any) -> list[tuple[torch.Tensor, int]]:
    """(tensor, plane index within it) for each K/V plane of a layer's cache value."""
    if group.layout.tensors_per_layer == 2:
        return [(value[0], 0), (value[1], 0)]
    return [(value, plane) for plane in range(group.kv_size)]


def _copy_generic(group: KVLayerGroupInfo, tensor: torch.Tensor, plane: int, plan: TokenPlan,
                  rows: torch.Tensor, scatter: bool) -> None:
    token_major = to_token_major(group.layout, tensor, plane)
    tokens = rows.view(plan.num_tokens, *token_major.shape[2:])
    if scatter:
        token_major.index_put_((plan.blocks, plan.offsets), tokens)
    else:
        tokens.copy_(token_major[plan.blocks, plan.offsets])


def copy_tokens(
    group: KVLayerGroupInfo, layer_values: Sequence[Any], chunk: torch.Tensor, plan: TokenPlan, scatter: bool
) -> None:
    """Move the plan's tokens of every layer of a token group between its caches and ``chunk``.

    ``chunk`` is contiguous, ``[kv_size, num_layers, num_tokens, hidden_dim_size]``, on the caches'
    device; ``scatter`` writes the caches, otherwise ``chunk`` is filled.
    """
    if not plan.num_tokens:
        return
    planes = [_plane_tensors(group, value) for value in layer_values]
    first = planes[0][0][0]
    shared = row_map(group, first)
    num_planes, num_layers = group.kv_size, group.num_layers
    if shared is not None and _copy_pooled(group, planes, shared, chunk, plan, scatter):
        return
    split = plan.num_block_tokens if shared is not None and shared.blocks_contiguous else 0
    item = first.element_size()
    # Scatters reinterpret rows as one wide type for the whole group, chosen so that every row,
    # stride and offset involved stays whole; gathers keep the native type (index_select is a memcpy).
    row_type = first.dtype
    if scatter and shared is not None:
        offsets = {int(tensor.storage_offset()) for layer_planes in planes for tensor, _ in layer_planes}
        row_type = widest(
            shared.hidden * item, shared.block_stride * item, shared.offset_stride * item,
            int(chunk.storage_offset()) * item,
            *(offset * item for offset in offsets), *(offset * item for offset in shared.plane_offsets),
        )
    rows_per_plane = chunk.view(num_planes * num_layers, plan.num_tokens, -1)
    typed_rows = rows_per_plane.view(row_type)
    # Destinations as prebuilt views (one C++ call for all planes instead of indexing in the loop).
    block_targets: Sequence[torch.Tensor] = ()
    if split:
        block_targets = typed_rows[:, :split].view(num_planes * num_layers, split // group.block_size, -1).unbind(0)
    token_targets: Sequence[torch.Tensor] = typed_rows[:, split:].unbind(0) if split < plan.num_tokens else ()
    token_indices = None
    if shared is not None and split < plan.num_tokens:
        token_indices = (plan.blocks[split:] * (shared.block_stride // shared.hidden)
                         + plan.offsets[split:] * (shared.offset_stride // shared.hidden))
    for layer, layer_planes in enumerate(planes):
        for plane_index, (tensor, plane) in enumerate(layer_planes):
            target = plane_index * num_layers + layer
            if shared is None or tensor.stride() != shared.strides:
                _copy_generic(group, tensor, plane, plan, rows_per_plane[target], scatter)
                continue
            base = tensor.storage_offset() + shared.plane_offsets[plane]
            if split:
                view = tensor.as_strided(
                    (shared.num_blocks, shared.block_size * shared.hidden), (shared.block_stride, 1), base
                )
                _copy_typed_rows(view, block_targets[target], plan.block_ids, scatter)
            if token_indices is not None:
                view = tensor.as_strided((shared.num_rows, shared.hidden), (shared.hidden, 1), base)
                _copy_typed_rows(view, token_targets[target], token_indices, scatter)


def _copy_typed_rows(rows: torch.Tensor, chunk_rows: torch.Tensor, indices: torch.Tensor, scatter: bool) -> None:
    """``rows``: native-type row view of a cache; ``chunk_rows``: the chunk's rows, maybe reinterpreted."""
    if chunk_rows.dtype != rows.dtype:
        rows = rows.view(chunk_rows.dtype)
    if scatter:
        rows.index_put_((indices,), chunk_rows)
    else:
        torch.index_select(rows, 0, indices, out=chunk_rows)


def _layer_step(planes: Sequence[Sequence[tuple[torch.Tensor, int]]], plane_index: int,
                shared: RowMap) -> int | None:
    """Elements between consecutive layers' planes when all share one storage evenly, else None."""
    tensors = [layer_planes[plane_index][0] for layer_planes in planes]
    storage = tensors[0].untyped_storage().data_ptr()
    offsets = [int(tensor.storage_offset()) for tensor in tensors]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    for tensor, offset, previous in zip(tensors[1:], offsets[1:], offsets, strict=False):
        if (offset - previous != step or tensor.stride() != shared.strides
                or tensor.untyped_storage().data_ptr() != storage):
            return None
    return step


def _copy_pooled(
    group: KVLayerGroupInfo, planes: Sequence[Sequence[tuple[torch.Tensor, int]]], shared: RowMap,
    chunk: torch.Tensor, plan: TokenPlan, scatter: bool,
) -> bool:
    """One copy per K/V plane for all layers, when the layers are evenly spaced views of one buffer.

    Engines that allocate one pool for every layer (rather than a tensor per layer) get this:
    the layers' rows are then rows of a single 2-D view, and ``chunk[plane]`` is one contiguous
    ``[num_layers * num_tokens, hidden]`` run. Returns False (nothing copied) otherwise.
    """
    if len(planes) < 2:
        return False
    whole_blocks = plan.num_block_tokens == plan.num_tokens and shared.blocks_contiguous
    row_size = shared.block_size * shared.hidden if whole_blocks else shared.hidden
    row_stride = shared.block_stride if whole_blocks else shared.hidden
    steps: list[int] = []
    for index in range(len(planes[0])):
        step = _layer_step(planes, index, shared)
        if step is None or step <= 0 or step % row_stride:
            return False
        steps.append(step // row_stride)
    if whole_blocks:
        rows_in_layer, rows_per_layer = plan.block_ids, shared.num_blocks
    else:
        rows_in_layer = (plan.blocks * (shared.block_stride // shared.hidden)
                         + plan.offsets * (shared.offset_stride // shared.hidden))
        rows_per_layer = shared.num_rows
    layers = torch.arange(len(planes), device=rows_in_layer.device)
    item = chunk.element_size()
    for plane_index, layer_step_rows in enumerate(steps):
        tensor, plane = planes[0][plane_index]
        indices = (layers[:, None] * layer_step_rows + rows_in_layer[None, :]).flatten()
        num_rows = (len(planes) - 1) * layer_step_rows + rows_per_layer
        view = tensor.as_strided((num_rows, row_size), (row_stride, 1),
                                 tensor.storage_offset() + shared.plane_offsets[plane])
        chunk_rows = chunk[plane_index].view(indices.shape[0], row_size)
        if scatter:
            chunk_rows = chunk_rows.view(widest(row_size * item, row_stride * item, int(view.storage_offset()) * item,
                                                int(chunk_rows.storage_offset()) * item))
        _copy_typed_rows(view, chunk_rows, indices, scatter)
    return True


def state_tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def copy_states(layer_values: Sequence[Any], indices: torch.Tensor, chunk: torch.Tensor, scatter: bool) -> None:
    """Move state slots ``indices`` of every layer between the caches and ``chunk`` ``[1, L, n, S]``."""
    count = indices.shape[0]
    for layer, value in enumerate(layer_values):
        offset = 0
        for state in state_tensors(value):
            elements = state[0].numel()
            part = chunk[0, layer, :, offset:offset + elements]
            if scatter:
                state.index_put_((indices,), part.reshape(count, *state.shape[1:]))
            else:
                part.copy_(state.index_select(0, indices).reshape(count, elements))
            offset += elements
