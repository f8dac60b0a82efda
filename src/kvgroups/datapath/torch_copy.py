"""The torch copies of the data path: token rows and state slots between caches and chunk tensors.

A token's heads form one contiguous row in NHD layouts, and a block's tokens one contiguous run,
so each (layer, K/V plane) moves with one ``index_select`` (gather) or ``index_put_`` (scatter)
over a 2-D row view (``as_strided``) of the layer tensor's own storage. Scatters reinterpret rows
as the widest type their byte sizes allow: those kernels pay per element. Layouts whose token
rows are not contiguous (HND) use advanced indexing on a token-major view instead. Every view
aliases the caller's tensors, so writes land in the caches, permuted views included.

The views are built once per bound transfer (:class:`TokenCopier`, :class:`StateCopier`); a call
builds only what depends on its slots (:class:`TokenPlan`). This is the path for any device and
the reference the other kernels are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgroups.core.cpu_pages import amx_page_plane
from kvgroups.core.group_keys import Tensors, kv_planes
from kvgroups.core.layouts import KVLayout, to_token_major
from kvgroups.datapath.address_tables import widest_word
from kvgroups.datapath.slots import CallSlots, TokenPlan


@dataclass(frozen=True)
class RowMap:
    """Where the token rows of a layer tensor's K/V planes sit, in elements of its storage.

    Token ``(block, offset)`` of plane ``p`` starts at ``storage_offset + plane_offsets[p] +
    block * block_stride + offset * offset_stride`` and spans ``hidden`` contiguous elements.
    """

    strides: tuple[int, ...]  # the tensor strides this map was computed for
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

    def token_rows(self, plan: TokenPlan, start: int) -> torch.Tensor:
        """Row numbers (in units of ``hidden``) of the plan's tokens from ``start`` on."""
        return (plan.blocks[start:] * (self.block_stride // self.hidden)
                + plan.offsets[start:] * (self.offset_stride // self.hidden))


def row_map(layout: KVLayout, tensor: torch.Tensor) -> RowMap | None:
    """The row map of one layer tensor in ``layout``, or None when its token rows are not contiguous."""
    # A (k, v) pair's tensors each hold one plane; other layouts hold kv_size planes in one tensor.
    if layout is KVLayout.VLLM_CPU_AMX:
        return None  # no token has a row of its own in an amx page
    planes_in_tensor = 1 if layout.tensors_per_layer == 2 else layout.kv_size
    token_major = [to_token_major(layout, tensor, plane) for plane in range(planes_in_tensor)]
    num_blocks, block_size, num_heads, head_size = token_major[0].shape
    block_stride, offset_stride, head_stride, element_stride = token_major[0].stride()
    hidden = num_heads * head_size
    if any(view.stride() != token_major[0].stride() for view in token_major[1:]):
        return None  # K and V pages laid out differently (VLLM_CPU)
    if (element_stride != 1 and head_size > 1) or (head_stride != head_size and num_heads > 1):
        return None
    if block_stride % hidden or offset_stride % hidden:
        return None
    base = int(tensor.storage_offset())
    return RowMap(
        strides=tuple(tensor.stride()),
        plane_offsets=tuple(int(view.storage_offset()) - base for view in token_major),
        block_stride=block_stride, offset_stride=offset_stride, hidden=hidden,
        num_blocks=num_blocks, block_size=block_size,
    )


def _copy_rows(rows: torch.Tensor, chunk_rows: torch.Tensor, indices: torch.Tensor, scatter: bool) -> None:
    """``rows``: a row view of a cache; ``chunk_rows``: the chunk's rows, maybe reinterpreted."""
    if chunk_rows.dtype != rows.dtype:
        rows = rows.view(chunk_rows.dtype)
    if scatter:
        rows.index_put_((indices,), chunk_rows)
    else:
        torch.index_select(rows, 0, indices, out=chunk_rows)


def _copy_token_major(token_major: torch.Tensor, plan: TokenPlan, rows: torch.Tensor, scatter: bool) -> None:
    """``rows`` (the plan's tokens, maybe strided) and a token-major view of one plane of a cache."""
    tokens = rows.view(plan.num_tokens, *token_major.shape[2:])
    if scatter:
        token_major.index_put_((plan.blocks, plan.offsets), tokens)
    else:
        tokens.copy_(token_major[plan.blocks, plan.offsets])


@dataclass(frozen=True)
class _PooledPlane:
    """One K/V plane of every layer as rows of a single view (layers evenly spaced in one buffer)."""

    token_view: torch.Tensor | None  # rows of `hidden` elements
    token_step: int  # rows between consecutive layers
    block_view: torch.Tensor | None  # rows of one whole block
    block_step: int


class TokenCopier:
    """The copies of one token-indexed group, with every view they need built once.

    ``layers`` are the group's layer values as tensors (checked against the group already).
    Values of a head size of their own (``value_head_size``) are copied plane by plane through
    token-major views, into the keys' and the values' columns of each chunk row.
    """

    def __init__(self, layout: KVLayout, block_size: int, layers: Sequence[Tensors],
                 value_head_size: int | None = None) -> None:
        self.layout = layout
        self.block_size = block_size
        self.planes = [kv_planes(layout, tensors) for tensors in layers]
        self.num_layers = len(self.planes)
        self.num_planes = len(self.planes[0])
        first = self.planes[0][0][0]
        self.item = first.element_size()
        self.shared = row_map(layout, first) if value_head_size is None else None
        # Keys and values of their own head sizes: each layer's K and V planes as token-major views.
        self.split_views = [] if value_head_size is None else [
            [to_token_major(layout, tensor, plane, value_head_size) for tensor, plane in layer]
            for layer in self.planes]
        # vLLM's amx pages: each layer's K and V planes as views whose token axis is split in groups.
        self.grouped_views = [] if layout is not KVLayout.VLLM_CPU_AMX else [
            [amx_page_plane(tensor, plane) for tensor, plane in layer] for layer in self.planes]
        self.pooled = self._pooled_planes() if self.shared is not None and self.num_layers > 1 else None
        # Per (plane, layer): (block-row view or None, token-row view) over the layer's own storage,
        # or None where the layer's strides differ from the first (copied through a token-major view).
        self.views: list[tuple[torch.Tensor | None, torch.Tensor] | None] = []
        self.scatter_type = first.dtype
        if self.shared is not None:
            offsets = {int(tensor.storage_offset()) for layer in self.planes for tensor, _ in layer}
            shared = self.shared
            # One wide type for the whole group, such that every row, stride and offset stays whole.
            self.scatter_type = widest_word(
                shared.hidden * self.item, shared.block_stride * self.item, shared.offset_stride * self.item,
                *(offset * self.item for offset in offsets), *(offset * self.item for offset in shared.plane_offsets),
            )
        for plane_index in range(self.num_planes):
            for layer_planes in self.planes:
                tensor, plane = layer_planes[plane_index]
                self.views.append(self._row_views(tensor, plane))

    def _row_views(self, tensor: torch.Tensor, plane: int) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        shared = self.shared
        if shared is None or tuple(tensor.stride()) != shared.strides:
            return None
        base = tensor.storage_offset() + shared.plane_offsets[plane]
        block_view = None
        if shared.blocks_contiguous:
            block_view = tensor.as_strided(
                (shared.num_blocks, shared.block_size * shared.hidden), (shared.block_stride, 1), base
            )
        return block_view, tensor.as_strided((shared.num_rows, shared.hidden), (shared.hidden, 1), base)

    def _pooled_planes(self) -> list[_PooledPlane] | None:
        """Views over all layers of each plane when the layers are evenly spaced views of one buffer."""
        shared = self.shared
        assert shared is not None
        pooled = []
        for plane_index in range(self.num_planes):
            tensors = [layer[plane_index][0] for layer in self.planes]
            storage = tensors[0].untyped_storage().data_ptr()
            offsets = [int(tensor.storage_offset()) for tensor in tensors]
            step = offsets[1] - offsets[0]
            if step <= 0 or any(
                offset - previous != step or tuple(tensor.stride()) != shared.strides
                or tensor.untyped_storage().data_ptr() != storage
                for tensor, offset, previous in zip(tensors[1:], offsets[1:], offsets, strict=False)
            ):
                return None
            tensor, plane = self.planes[0][plane_index]
            base = tensor.storage_offset() + shared.plane_offsets[plane]
            token_view = block_view = None
            if step % shared.hidden == 0:
                rows = (self.num_layers - 1) * (step // shared.hidden) + shared.num_rows
                token_view = tensor.as_strided((rows, shared.hidden), (shared.hidden, 1), base)
            if shared.blocks_contiguous and step % shared.block_stride == 0:
                rows = (self.num_layers - 1) * (step // shared.block_stride) + shared.num_blocks
                block_view = tensor.as_strided(
                    (rows, shared.block_size * shared.hidden), (shared.block_stride, 1), base
                )
            pooled.append(_PooledPlane(token_view, step // shared.hidden, block_view, step // shared.block_stride))
        return pooled

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        """Move the call's tokens of every layer between the caches and ``chunk``.

        ``chunk`` is contiguous, ``[kv_size, num_layers, num_tokens, hidden_dim_size]``, on the
        caches' device; ``scatter`` writes the caches, otherwise ``chunk`` is filled.
        """
        plan = call.plan(self.block_size)
        if plan is None or not plan.num_tokens:
            return
        if self.pooled is not None and self._copy_pooled(chunk, plan, scatter):
            return
        if self.split_views:
            self._copy_split_rows(chunk, plan, scatter)
            return
        if self.grouped_views:
            self._copy_grouped(chunk, plan, scatter)
            return
        shared = self.shared
        split = plan.num_block_tokens if shared is not None and shared.blocks_contiguous else 0
        row_type = self.scatter_type if scatter else chunk.dtype
        if scatter and chunk.storage_offset():
            row_type = widest_word(row_type.itemsize, int(chunk.storage_offset()) * self.item)
        rows_per_plane = chunk.view(self.num_planes * self.num_layers, plan.num_tokens, -1)
        typed_rows = rows_per_plane.view(row_type)
        block_targets: Sequence[torch.Tensor] = ()
        if split:
            block_targets = typed_rows[:, :split].view(
                self.num_planes * self.num_layers, split // self.block_size, -1
            ).unbind(0)
        token_targets: Sequence[torch.Tensor] = typed_rows[:, split:].unbind(0) if split < plan.num_tokens else ()
        token_indices = shared.token_rows(plan, split) if shared is not None and split < plan.num_tokens else None
        for target, views in enumerate(self.views):
            if views is None:
                tensor, plane = self.planes[target % self.num_layers][target // self.num_layers]
                _copy_token_major(to_token_major(self.layout, tensor, plane), plan, rows_per_plane[target], scatter)
                continue
            block_view, token_view = views
            if split and block_view is not None:
                _copy_rows(block_view, block_targets[target], plan.block_ids, scatter)
            if token_indices is not None:
                _copy_rows(token_view, token_targets[target], token_indices, scatter)

    def _copy_split_rows(self, chunk: torch.Tensor, plan: TokenPlan, scatter: bool) -> None:
        """Keys and values of different head sizes: chunk ``[1, num_layers, tokens, keys + values]``."""
        for layer, views in enumerate(self.split_views):
            column = 0
            for token_major in views:
                width = token_major.shape[2] * token_major.shape[3]
                _copy_token_major(token_major, plan, chunk[0, layer, :, column:column + width], scatter)
                column += width

    def _copy_grouped(self, chunk: torch.Tensor, plan: TokenPlan, scatter: bool) -> None:
        """Pages whose token axis is split in groups (vLLM's amx pages): whole blocks move as whole
        pages, every other token through its group and its place in the group."""
        split = plan.num_block_tokens
        rows = chunk.view(self.num_planes, self.num_layers, plan.num_tokens, -1)
        groups: dict[int, torch.Tensor] = {}
        within: dict[int, torch.Tensor] = {}
        for layer, views in enumerate(self.grouped_views):
            for plane, (view, group) in enumerate(views):
                if split:
                    pages = rows[plane, layer, :split].view(-1, *view.shape[1:])
                    if scatter:
                        view.index_copy_(0, plan.block_ids, pages)
                    else:
                        torch.index_select(view, 0, plan.block_ids, out=pages)
                if split == plan.num_tokens:
                    continue
                if group not in groups:
                    offsets = plan.offsets[split:]
                    groups[group], within[group] = offsets // group, offsets % group
                tokens = rows[plane, layer, split:].view(-1, *view.shape[3:])
                index = (plan.blocks[split:], groups[group], within[group])
                if scatter:
                    view.index_put_(index, tokens)
                else:
                    tokens.copy_(view[index])

    def _copy_pooled(self, chunk: torch.Tensor, plan: TokenPlan, scatter: bool) -> bool:
        """One copy per K/V plane for all layers; False (nothing copied) when the views do not serve."""
        shared, pooled = self.shared, self.pooled
        assert shared is not None and pooled is not None
        whole_blocks = plan.num_block_tokens == plan.num_tokens and shared.blocks_contiguous
        if any((plane.block_view if whole_blocks else plane.token_view) is None for plane in pooled):
            return False
        rows_in_layer = plan.block_ids if whole_blocks else shared.token_rows(plan, 0)
        layers = torch.arange(self.num_layers, device=rows_in_layer.device)
        row_size = shared.block_size * shared.hidden if whole_blocks else shared.hidden
        for plane_index, plane in enumerate(pooled):
            view = plane.block_view if whole_blocks else plane.token_view
            assert view is not None
            step = plane.block_step if whole_blocks else plane.token_step
            indices = (layers[:, None] * step + rows_in_layer[None, :]).flatten()
            chunk_rows = chunk[plane_index].view(indices.shape[0], row_size)
            if scatter:
                chunk_rows = chunk_rows.view(widest_word(
                    row_size * self.item, view.stride(0) * self.item, int(view.storage_offset()) * self.item,
                    int(chunk_rows.storage_offset()) * self.item,
                ))
            _copy_rows(view, chunk_rows, indices, scatter)
        return True


class StateCopier:
    """The copies of one recurrent group: each layer's state tensors, by state slot."""

    def __init__(self, layers: Sequence[Tensors]) -> None:
        self.layers = [[(state, math.prod(state.shape[1:])) for state in tensors] for tensors in layers]

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        """Move the call's state slots of every layer between the caches and ``chunk`` ``[1, L, n, S]``."""
        indices = call.state_indices
        if indices is None:
            return
        count = indices.shape[0]
        for layer, states in enumerate(self.layers):
            offset = 0
            for state, elements in states:
                part = chunk[0, layer, :, offset:offset + elements]
                if scatter:
                    state.index_put_((indices,), part.reshape(count, *state.shape[1:]))
                else:
                    part.copy_(state.index_select(0, indices).reshape(count, elements))
                offset += elements
