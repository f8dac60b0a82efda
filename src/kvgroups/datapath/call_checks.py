"""The checks of a call of :class:`~kvgroups.datapath.transfer.KVTransfer`: everything it is handed, before any copy.

Slots and state slots are read as NumPy arrays where they are (a CPU tensor's memory, an array) and
checked by NumPy in reused arrays: a call of a size seen before allocates nothing and runs no torch
operation. Errors name the group, the slot or row, and what was expected.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.datapath.slots import CallSlots
from kvgroups.errors import ChunkMismatchError, KVGroupsError, SlotMappingError


class CallChecks:
    """The checks of calls on ``groups``, bound on ``device``."""

    def __init__(self, groups: list[KVLayerGroupInfo], device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self._token_groups = [group for group in groups if group.token_indexed]
        self._recurrent = [index for index, group in enumerate(groups) if not group.token_indexed]
        # Slots of every token group must fall below the smallest one's capacity.
        self.slot_limit = min((group.geometry.num_slots for group in self._token_groups), default=0)
        self._local = threading.local()  # reused arrays, per thread (loads run on several)

    def rows(self, rows: Any, num_tokens: int) -> int:
        """The rows a chunk needs to hold ``rows``; raises unless they are one NumPy int64 row per slot, distinct."""
        if not (isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.ndim == 1):
            raise TypeError(f"rows must be a 1-D NumPy int64 array, got {type(rows).__name__}")
        if rows.size != num_tokens:
            raise SlotMappingError(f"rows has {rows.size} entries for {num_tokens} slots; pass one row per slot")
        if not rows.size:
            return 0
        if int(rows.min()) < 0:
            raise SlotMappingError(f"rows {rows[rows < 0][:8].tolist()} are negative")
        if np.unique(rows).size != rows.size:
            raise SlotMappingError("rows names a chunk row twice; each slot takes a row of its own")
        return int(rows.max()) + 1

    def call(self, slot_mapping: Any, start: int, end: int | None, state_indices: Any, *,
                    distinct: bool) -> CallSlots:
        values = device_slots = None
        if self._token_groups:
            if slot_mapping is None:
                raise KVGroupsError("these groups hold token-indexed caches; pass a slot_mapping")
            values, device_slots = self._slots(slot_mapping, start, end, distinct)
        states = self._state_indices(state_indices, distinct)
        return CallSlots(self.device, values, states, device_slots)

    def _slots(self, slot_mapping: Any, start: int, end: int | None,
                     distinct: bool) -> tuple[np.ndarray, torch.Tensor | None]:
        """The call's slots as a NumPy array, checked, and the caller's tensor of them where it is on the caches'
        device. A CPU tensor or an array is read where it is: no torch operation, no copy."""
        device_slots = None
        if isinstance(slot_mapping, np.ndarray):
            values = slot_mapping
        elif isinstance(slot_mapping, torch.Tensor):
            if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
                raise TypeError(f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} of shape "
                                f"{list(slot_mapping.shape)}")
            if slot_mapping.is_cpu:
                values = slot_mapping.numpy()
            else:  # read back once to be checked; the kernels then use the caller's tensor where it is
                device_slots = slot_mapping
                values = slot_mapping.cpu().numpy()
        else:
            raise TypeError(f"slot_mapping must be an int64 tensor, got {type(slot_mapping).__name__}")
        if values.dtype != np.int64 or values.ndim != 1:
            raise TypeError(f"slot_mapping must be a 1-D int64 array, got {values.dtype} of shape {list(values.shape)}")
        length = values.shape[0]
        end = length if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= length):
            raise SlotMappingError(f"token range start={start}, end={end} must satisfy 0 <= start <= end <= {length}")
        if start or end != length:
            values = values[start:end]
            device_slots = None if device_slots is None else device_slots[start:end]
        if device_slots is not None and device_slots.device != self.device:
            device_slots = None
        # NumPy answers these questions on a few hundred slots in microseconds, torch in tens of them.
        if values.size:
            # One reduction for both bounds: read as unsigned, a negative slot is beyond every limit.
            if int(values.view(np.uint64).max()) >= self.slot_limit:
                self._raise_out_of_range(values)
            if distinct and self._repeats(values):
                ordered = np.sort(values)
                repeated = ordered[1:][ordered[1:] == ordered[:-1]]
                raise SlotMappingError(f"slot_mapping maps several tokens to slots "
                                       f"{np.unique(repeated)[:8].tolist()}; two tokens cannot own one slot")
        return values, device_slots

    def _repeats(self, values: np.ndarray) -> bool:
        """Whether a slot repeats, sorted in a reused array (a call of a size seen before allocates nothing)."""
        size = values.size
        local = self._local
        if size > getattr(local, "size", -1):
            local.sorted, local.equal, local.size = np.empty(size, dtype=np.int64), np.empty(size, dtype=bool), size
        ordered = local.sorted[:size]
        ordered[:] = values
        ordered.sort()
        equal = local.equal[:size - 1]
        np.equal(ordered[1:], ordered[:-1], out=equal)
        return bool(equal.any())

    def _raise_out_of_range(self, values: np.ndarray) -> None:
        for index, group in enumerate(self.groups):
            if not group.token_indexed:
                continue
            capacity = group.geometry.num_slots
            bad = np.flatnonzero((values < 0) | (values >= capacity))
            if bad.size:
                shown = ", ".join(f"token {int(i)}: slot {int(values[i])}" for i in bad[:5])
                raise SlotMappingError(
                    f"{bad.size} slot(s) outside group {index}'s [0, {capacity}) "
                    f"({group.num_blocks} blocks x {group.block_size}): {shown}"
                )

    def _state_indices(self, state_indices: Any, distinct: bool) -> np.ndarray | None:
        if not self._recurrent:
            return None
        if state_indices is None:
            raise KVGroupsError(
                f"groups {self._recurrent} hold recurrent state, which is not token-indexed; pass state_indices "
                f"(one state slot per sequence)"
            )
        if isinstance(state_indices, torch.Tensor) and state_indices.is_cpu and state_indices.dtype == torch.int64:
            indices = state_indices.numpy().reshape(-1)
        elif isinstance(state_indices, torch.Tensor):
            indices = state_indices.detach().cpu().numpy().astype(np.int64).reshape(-1)
        else:
            indices = np.asarray(state_indices, dtype=np.int64).reshape(-1)
        # One reduction for both bounds (a negative index read as unsigned is beyond every group's slots).
        largest = int(indices.view(np.uint64).max()) if indices.size else -1
        for index in self._recurrent:
            slots = self.groups[index].num_blocks
            if largest >= slots:
                bad = indices[(indices < 0) | (indices >= slots)]
                raise SlotMappingError(f"state_indices {bad.tolist()} outside group {index}'s [0, {slots}) state slots")
        if distinct and indices.size > 1 and np.unique(indices).size != indices.size:
            raise SlotMappingError(f"state_indices {indices.tolist()} repeat a slot; two sequences cannot own one")
        return indices

    def chunk(self, index: int, chunk: Any, shape: torch.Size, what: str) -> None:
        group = self.groups[index]
        if not isinstance(chunk, torch.Tensor):
            raise TypeError(f"{what} for group {index} must be a tensor, got {type(chunk).__name__}")
        if chunk.shape != shape or chunk.dtype != group.dtype:
            raise ChunkMismatchError(
                f"{what} for group {index} is {list(chunk.shape)} {chunk.dtype}; group {index} "
                f"({group.kind.value}, layers {group.layer_names[:2]}...) needs {list(shape)} {group.dtype}"
            )
        if not chunk.is_contiguous():
            raise ChunkMismatchError(f"{what} for group {index} must be contiguous")

