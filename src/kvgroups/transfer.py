"""The data path: copy token ranges between an engine's paged caches and per-group chunk tensors.

``pack`` gathers the tokens at ``slot_mapping`` (``slot = block_id * block_size + offset``, the
vLLM convention) of every layer of a group into one ``[kv_size, num_layers, num_tokens,
hidden_dim_size]`` tensor, exactly ``metadata.get_shapes(num_tokens)`` / ``get_dtypes()``;
``unpack`` scatters such tensors back. Recurrent-state groups are not token-indexed: they move by
state slot (one per sequence), ``[1, num_layers, num_states, state_elements]``, through
``state_indices``.

This module validates everything before the first copy (slots, chunks, layers) and handles
devices; :mod:`kvgroups.row_copy` does the copies, in plain torch on any device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.errors import ChunkMismatchError, KVGroupsError, SlotMappingError
from kvgroups.formatting import describe_value
from kvgroups.groups import KVLayerGroupInfo, KVLayerGroupsManager
from kvgroups.kinds import RecurrentState
from kvgroups.row_copy import TokenPlan, copy_states, copy_tokens, plan_tokens

Groups = KVLayerGroupsManager | Sequence[KVLayerGroupInfo]


def _group_list(groups: Groups) -> list[KVLayerGroupInfo]:
    if isinstance(groups, KVLayerGroupsManager):
        return list(groups.kv_layer_groups)
    if isinstance(groups, Sequence) and all(isinstance(group, KVLayerGroupInfo) for group in groups):
        return list(groups)
    raise TypeError(f"groups must be a KVLayerGroupsManager or a list of KVLayerGroupInfo, got {groups!r}")


def _layer_matches(group: KVLayerGroupInfo, value: Any) -> bool:
    """Whether a K/V pair or a recurrent layer's states fit ``group``."""
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    spec = group.spec
    if isinstance(spec, RecurrentState):
        shapes = [list(shape) for shape in spec.state_shapes]
        return len(tensors) == len(shapes) and all(
            isinstance(t, torch.Tensor) and list(t.shape[1:]) == s and t.shape[0] == group.num_blocks
            and t.dtype == group.dtype for t, s in zip(tensors, shapes, strict=False)
        )
    # Only K/V pairs get here: single-tensor layers are checked inline by _layer_values.
    return len(tensors) == 2 and all(
        isinstance(t, torch.Tensor) and t.shape == group.shape and t.dtype == group.dtype for t in tensors
    )


def _first_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def _layer_values(
    groups: list[KVLayerGroupInfo], kv_caches: Mapping[str, Any]
) -> tuple[list[list[Any]], torch.device]:
    """The caches of every group's layers, checked against the groups, and their one device."""
    if not isinstance(kv_caches, Mapping):
        raise TypeError(f"kv_caches must be a dict of layer name -> cache, got {type(kv_caches).__name__}")
    missing = [name for group in groups for name in group.layer_names if name not in kv_caches]
    if missing:
        raise KVGroupsError(f"kv_caches lacks layers the groups name: {missing}")
    values = []
    device: torch.device | None = None
    for index, group in enumerate(groups):
        layer_values = [kv_caches[name] for name in group.layer_names]
        single = group.layout.tensors_per_layer == 1
        for name, value in zip(group.layer_names, layer_values, strict=True):
            # The common case (one tensor of the group's shape and dtype) costs three comparisons.
            fits = (single and isinstance(value, torch.Tensor) and value.shape == group.shape
                    and value.dtype == group.dtype) or (not single and _layer_matches(group, value))
            if not fits:
                raise KVGroupsError(
                    f"layer {name!r} of group {index} is {describe_value(value)}; the group expects "
                    f"{group.layout.tensors_per_layer or 'state'} tensor(s) {list(group.shape)} {group.dtype} "
                    f"in layout {group.layout.value}"
                )
            layer_device = _first_tensor(value).device
            if device is None:
                device = layer_device
            elif layer_device != device:
                raise KVGroupsError(f"layer {name!r} is on {layer_device}, other layers on {device}; "
                                    f"all caches must be on one device")
        values.append(layer_values)
    return values, device or torch.device("cpu")


@dataclass(frozen=True)
class _Slots:
    """A validated token range of a slot mapping, on the caches' device."""

    slots: torch.Tensor  # [num_tokens] int64
    cpu_slots: torch.Tensor
    num_tokens: int


def _slot_range(slot_mapping: Any, start: int, end: int | None, device: torch.device) -> _Slots:
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be an int64 tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        raise TypeError(
            f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} of shape {list(slot_mapping.shape)}"
        )
    length = slot_mapping.shape[0]
    end = length if end is None else end
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= length):
        raise SlotMappingError(f"token range start={start}, end={end} must satisfy 0 <= start <= end <= {length}")
    slots = slot_mapping[start:end]
    cpu_slots = slots.cpu()
    return _Slots(slots=slots.to(device), cpu_slots=cpu_slots, num_tokens=end - start)


def _check_slots_in_range(slots: _Slots, group_index: int, group: KVLayerGroupInfo) -> None:
    capacity = group.num_blocks * group.block_size
    bad = ((slots.cpu_slots < 0) | (slots.cpu_slots >= capacity)).nonzero().flatten()
    if bad.numel():
        shown = ", ".join(f"token {int(i)}: slot {int(slots.cpu_slots[i])}" for i in bad[:5])
        raise SlotMappingError(
            f"{bad.numel()} slot(s) outside group {group_index}'s [0, {capacity}) "
            f"({group.num_blocks} blocks x {group.block_size}): {shown}"
        )


def _check_distinct(slots: _Slots) -> None:
    unique, counts = torch.unique(slots.cpu_slots, return_counts=True)
    duplicated = unique[counts > 1]
    if duplicated.numel():
        raise SlotMappingError(
            f"slot_mapping maps several tokens to slots {duplicated[:8].tolist()}; two tokens cannot own one slot"
        )


def _expected_shape(group: KVLayerGroupInfo, num_tokens: int, num_states: int) -> torch.Size:
    count = num_tokens if group.layout.is_token_indexed else num_states
    return torch.Size([group.kv_size, group.num_layers, count, group.hidden_dim_size])


def _check_chunk(index: int, group: KVLayerGroupInfo, chunk: Any, shape: torch.Size, what: str) -> None:
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"{what} for group {index} must be a tensor, got {type(chunk).__name__}")
    if chunk.shape != shape or chunk.dtype != group.dtype:
        raise ChunkMismatchError(
            f"{what} for group {index} is {list(chunk.shape)} {chunk.dtype}; group {index} "
            f"({group.kind.value}, layers {group.layer_names[:2]}...) needs {list(shape)} {group.dtype}"
        )
    if not chunk.is_contiguous():
        raise ChunkMismatchError(f"{what} for group {index} must be contiguous")


def _check_state_indices(state_indices: Any, groups: list[KVLayerGroupInfo]) -> torch.Tensor | None:
    recurrent = [index for index, group in enumerate(groups) if not group.layout.is_token_indexed]
    if not recurrent:
        return None
    if state_indices is None:
        raise KVGroupsError(
            f"groups {recurrent} hold recurrent state, which is not token-indexed; pass state_indices "
            f"(one state slot per sequence)"
        )
    indices = torch.as_tensor(state_indices, dtype=torch.int64).flatten()
    for index in recurrent:
        slots = groups[index].num_blocks
        bad = indices[(indices < 0) | (indices >= slots)]
        if bad.numel():
            raise SlotMappingError(f"state_indices {bad.tolist()} outside group {index}'s [0, {slots}) state slots")
    return indices


@dataclass(frozen=True)
class _Prepared:
    groups: list[KVLayerGroupInfo]
    values: list[list[Any]]
    device: torch.device
    slots: _Slots | None
    state_indices: torch.Tensor | None
    num_tokens: int
    num_states: int


def _prepare(
    groups: Groups, kv_caches: Mapping[str, Any], slot_mapping: Any, start: int, end: int | None,
    state_indices: Any, *, distinct: bool,
) -> _Prepared:
    group_list = _group_list(groups)
    values, device = _layer_values(group_list, kv_caches)
    slots = None
    if any(group.layout.is_token_indexed for group in group_list):
        if slot_mapping is None:
            raise KVGroupsError("these groups hold token-indexed caches; pass a slot_mapping")
        slots = _slot_range(slot_mapping, start, end, device)
        for index, group in enumerate(group_list):
            if group.layout.is_token_indexed:
                _check_slots_in_range(slots, index, group)
        if distinct:
            _check_distinct(slots)
    indices = _check_state_indices(state_indices, group_list)
    if indices is not None and distinct and torch.unique(indices).numel() != indices.numel():
        raise SlotMappingError(f"state_indices {indices.tolist()} repeat a slot; two sequences cannot own one")
    return _Prepared(
        groups=group_list, values=values, device=device, slots=slots,
        state_indices=None if indices is None else indices.to(device),
        num_tokens=0 if slots is None else slots.num_tokens,
        num_states=0 if indices is None else indices.shape[0],
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _move(prepared: _Prepared, chunks: list[torch.Tensor], scatter: bool) -> None:
    plans: dict[int, TokenPlan] = {}
    for group, layer_values, chunk in zip(prepared.groups, prepared.values, chunks, strict=True):
        if not group.layout.is_token_indexed:
            if prepared.state_indices is not None:
                copy_states(layer_values, prepared.state_indices, chunk, scatter)
            continue
        if prepared.slots is None:
            continue
        plan = plans.get(group.block_size)
        if plan is None:
            plan = plans[group.block_size] = plan_tokens(
                prepared.slots.slots, prepared.slots.cpu_slots, group.block_size
            )
        copy_tokens(group, layer_values, chunk, plan, scatter)


def pack(
    groups: Groups,
    kv_caches: Mapping[str, Any],
    slot_mapping: torch.Tensor | None = None,
    *,
    start: int = 0,
    end: int | None = None,
    state_indices: torch.Tensor | Sequence[int] | int | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Gather tokens ``slot_mapping[start:end]`` of every group into one chunk tensor per group.

    Token groups give ``[kv_size, num_layers, num_tokens, hidden_dim_size]`` in the group's dtype
    (``metadata.get_shapes(num_tokens)``); recurrent groups give the states of
    ``state_indices``, ``[1, num_layers, len(state_indices), state_elements]``. ``out``, one
    contiguous tensor per group on any device (pinned CPU memory for GPU caches), is filled
    instead of allocating on the caches' device. Everything is validated before any copy; the
    caches are only read.
    """
    prepared = _prepare(groups, kv_caches, slot_mapping, start, end, state_indices, distinct=False)
    shapes = [_expected_shape(group, prepared.num_tokens, prepared.num_states) for group in prepared.groups]
    if out is None:
        results = [
            torch.empty(shape, dtype=group.dtype, device=prepared.device)
            for group, shape in zip(prepared.groups, shapes, strict=True)
        ]
        _move(prepared, results, scatter=False)
        return results
    outputs = list(out)
    if len(outputs) != len(prepared.groups):
        raise ChunkMismatchError(f"out has {len(outputs)} tensors for {len(prepared.groups)} groups")
    for index, (group, chunk, shape) in enumerate(zip(prepared.groups, outputs, shapes, strict=True)):
        _check_chunk(index, group, chunk, shape, "out")
    staging = [
        chunk if chunk.device == prepared.device else torch.empty_like(chunk, device=prepared.device)
        for chunk in outputs
    ]
    _move(prepared, staging, scatter=False)
    asynchronous = False
    for chunk, staged in zip(outputs, staging, strict=True):
        if staged is not chunk:
            # A device-to-pinned copy may run asynchronously; one synchronize below covers all groups.
            non_blocking = chunk.is_pinned() and prepared.device.type == "cuda"
            chunk.copy_(staged, non_blocking=non_blocking)
            asynchronous |= non_blocking
    if asynchronous:
        _synchronize(prepared.device)
    return outputs


def unpack(
    groups: Groups,
    kv_caches: Mapping[str, Any],
    chunks: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor | None = None,
    *,
    start: int = 0,
    end: int | None = None,
    state_indices: torch.Tensor | Sequence[int] | int | None = None,
) -> None:
    """Write chunk tensors (as :func:`pack` returns them) into the caches at ``slot_mapping[start:end]``.

    Slots outside a group's cache, a slot named twice, and a chunk whose shape or dtype does
    not match its group raise before anything is written. Writes go through the caches' own
    storage, also for permuted (HND) views.
    """
    prepared = _prepare(groups, kv_caches, slot_mapping, start, end, state_indices, distinct=True)
    chunk_list = list(chunks) if isinstance(chunks, Sequence) else chunks
    if not isinstance(chunk_list, list) or len(chunk_list) != len(prepared.groups):
        count = len(chunk_list) if isinstance(chunk_list, list) else type(chunks).__name__
        raise ChunkMismatchError(f"got {count} chunks for {len(prepared.groups)} groups; pass one per group")
    for index, (group, chunk) in enumerate(zip(prepared.groups, chunk_list, strict=True)):
        shape = _expected_shape(group, prepared.num_tokens, prepared.num_states)
        _check_chunk(index, group, chunk, shape, "chunk")
    asynchronous = False
    staged = []
    for chunk in chunk_list:
        if chunk.device == prepared.device:
            staged.append(chunk)
            continue
        non_blocking = chunk.is_pinned() and prepared.device.type == "cuda"
        staged.append(chunk.to(prepared.device, non_blocking=non_blocking))
        asynchronous |= non_blocking
    _move(prepared, staged, scatter=True)
    if asynchronous:
        # The caller may refill its pinned chunks once we return: the uploads must be done by then.
        _synchronize(prepared.device)
