"""The data path: copy token ranges between an engine's paged caches and per-group chunk tensors.

:class:`KVTransfer` binds groups to the caches they were built from, checks every layer once and
builds the copy views; its ``pack`` gathers the tokens at ``slot_mapping`` (``slot = block_id *
block_size + offset``, the vLLM convention) of every layer of a group into one ``[kv_size,
num_layers, num_tokens, hidden_dim_size]`` tensor, exactly ``metadata.get_shapes(num_tokens)`` /
``get_dtypes()``; ``unpack`` scatters such tensors back. Recurrent-state groups are not
token-indexed: they move by state slot (one per sequence), ``[1, num_layers, num_states,
state_elements]``, through ``state_indices``. The module functions :func:`pack` / :func:`unpack`
bind on their first call and keep the binding on the groups for the next calls on the same,
unchanged caches (:mod:`~kvgroups.datapath.bindings`).

Everything a call is given (slots, state indices, chunks) is checked before the first copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvgroups.core.checks import is_int_at_least
from kvgroups.core.group_keys import Tensors, check_layer
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.datapath.bindings import bound_transfer
from kvgroups.datapath.buffers import ChunkPool
from kvgroups.datapath.kernels import Copier, choose_kernel, state_copier, token_copier
from kvgroups.datapath.slots import CallSlots
from kvgroups.datapath.staging import Staging
from kvgroups.errors import ChunkMismatchError, KVGroupsError, SlotMappingError

Groups = KVLayerGroupsManager | Sequence[KVLayerGroupInfo]
StateIndices = torch.Tensor | Sequence[int] | int | None


def _group_list(groups: Groups) -> list[KVLayerGroupInfo]:
    if isinstance(groups, KVLayerGroupsManager):
        return list(groups.kv_layer_groups)
    if isinstance(groups, Sequence) and all(isinstance(group, KVLayerGroupInfo) for group in groups):
        return list(groups)
    raise TypeError(f"groups must be a KVLayerGroupsManager or a list of KVLayerGroupInfo, got {groups!r}")


def _bind_layers(
    groups: list[KVLayerGroupInfo], kv_caches: Mapping[str, Any]
) -> tuple[list[list[Tensors]], torch.device]:
    """Every group's layer values as tensors, checked against the group, and their one device."""
    if not isinstance(kv_caches, Mapping):
        raise TypeError(f"kv_caches must be a dict of layer name -> cache, got {type(kv_caches).__name__}")
    missing = [name for group in groups for name in group.layer_names if name not in kv_caches]
    if missing:
        raise KVGroupsError(f"kv_caches lacks layers the groups name: {missing}")
    bound = []
    device: torch.device | None = None
    for index, group in enumerate(groups):
        key = group.key
        layers = []
        for name in group.layer_names:
            try:
                tensors = check_layer(key, kv_caches[name])
            except KVGroupsError as error:
                raise KVGroupsError(f"layer {name!r} of group {index} {error}") from None
            layer_device = tensors[0].device
            if device is None:
                device = layer_device
            elif layer_device != device:
                raise KVGroupsError(f"layer {name!r} is on {layer_device}, other layers on {device}; "
                                    f"all caches must be on one device")
            layers.append(tensors)
        bound.append(layers)
    return bound, device or torch.device("cpu")


class KVTransfer:
    """Groups bound to an engine's caches: checked once, then any number of ``pack`` / ``unpack`` calls.

    Args:
        groups: a :class:`~kvgroups.KVLayerGroupsManager` or a list of its groups, as built from
            ``kv_caches``.
        kv_caches: layer name -> cache value (a tensor in the group's layout, a ``(k, v)`` pair,
            or a recurrent layer's state tensors), the tensors the groups were built from.
        kernel: ``"numba"``, ``"triton"`` or ``"torch"`` to force one (default: ``$KVGROUPS_KERNEL``,
            else the fastest that runs on the caches' device, see :mod:`kvgroups.datapath.kernels`).
        num_threads: caps the CPU kernel's threads (default: ``torch.get_num_threads()`` at each
            call; calls under 4 MiB use one thread).

    Raises:
        TypeError: ``groups`` or ``kv_caches`` of the wrong type.
        KVGroupsError: a layer the groups name is missing, or does not match its group (shape,
            dtype, layout), layers on several devices, a bad kernel or thread count.

    Binding builds what the copies go through (address tables for the numba and Triton kernels,
    views for the torch path); a call then checks only its own slots and chunks. Bind again when
    the caches are reallocated or the groups change (a reallocation is detected at the next
    call). ``kernels`` lists the kernel serving each group. ``pack`` without ``out=`` returns
    chunks in memory it reuses once the caller has dropped every earlier chunk of that size (a
    loop over chunks then page-faults nothing).
    """

    def __init__(self, groups: Groups, kv_caches: Mapping[str, Any], *, kernel: str | None = None,
                 num_threads: int | None = None) -> None:
        if num_threads is not None and not is_int_at_least(num_threads, 1):
            raise KVGroupsError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        self.groups = _group_list(groups)
        layers, self.device = _bind_layers(self.groups, kv_caches)
        self.kernel = choose_kernel(self.device, kernel)
        chosen = [
            token_copier(self.kernel, group.layout, group.block_size, group_layers, num_threads, group.value_head_size,
                         group.geometry.num_slots)
            if group.token_indexed else state_copier(self.kernel, group_layers)
            for group, group_layers in zip(self.groups, layers, strict=True)
        ]
        self.kernels: list[str] = [name for name, _ in chosen]
        self._copiers: list[Copier] = [copier for _, copier in chosen]
        # Per group, how its kernel moves scattered rows where it measured that (the numba kernel), else "".
        self.lockstep: list[str] = [getattr(copier, "lockstep", "") for copier in self._copiers]
        self._pool = ChunkPool(self.device)
        token_groups = [group for group in self.groups if group.token_indexed]
        self._token_groups = token_groups
        self._recurrent = [index for index, group in enumerate(self.groups) if not group.token_indexed]
        # Slots of every token group must fall below the smallest one's capacity.
        self._slot_limit = min((group.geometry.num_slots for group in token_groups), default=0)
        self._state_limit = min((self.groups[index].num_blocks for index in self._recurrent), default=0)

    def pack(
        self,
        slot_mapping: torch.Tensor | None = None,
        *,
        start: int = 0,
        end: int | None = None,
        state_indices: StateIndices = None,
        out: Sequence[torch.Tensor] | None = None,
        staging: Sequence[torch.Tensor] | None = None,
        synchronize: bool = True,
    ) -> list[torch.Tensor]:
        """Gather tokens ``slot_mapping[start:end]`` of every group into one chunk tensor per group.

        Token groups give ``[kv_size, num_layers, num_tokens, hidden_dim_size]`` in the group's dtype
        (``metadata.get_shapes(num_tokens)``); recurrent groups give the states of
        ``state_indices``, ``[1, num_layers, len(state_indices), state_elements]``. ``out``, one
        contiguous tensor per group on any device (pinned CPU memory for GPU caches), is filled
        instead of allocating on the caches' device; ``staging``, one uint8 buffer per group on the
        caches' device of at least its chunk's bytes, is where the chunks of ``out`` on another
        device are gathered first (else a temporary buffer is). With ``synchronize=False`` copies
        to another device may still run on the current stream when this returns: the caller records
        an event there and waits for it before reading ``out``. Everything is checked before any
        copy; the caches are only read.
        """
        call = self._check_call(slot_mapping, start, end, state_indices, distinct=False)
        shapes = [group.slots_shape(call.num_tokens, call.num_states) for group in self.groups]
        if out is None:
            results = [self._pool.empty(shape, group.dtype) for group, shape in zip(self.groups, shapes, strict=True)]
            self._move(call, results, scatter=False)
            return results
        outputs = list(out)
        if len(outputs) != len(self.groups):
            raise ChunkMismatchError(f"out has {len(outputs)} tensors for {len(self.groups)} groups")
        for index, (chunk, shape) in enumerate(zip(outputs, shapes, strict=True)):
            self._check_chunk(index, chunk, shape, "out")
        copies = Staging(self.device)
        buffers = [copies.buffer_for(chunk) if staging is None else self._staged(index, chunk, staging)
                   for index, chunk in enumerate(outputs)]
        self._move(call, buffers, scatter=False)
        for chunk, buffer in zip(outputs, buffers, strict=True):
            if buffer is not chunk:
                copies.copy(chunk, buffer)
        if synchronize:
            copies.finish()
        return outputs

    def _staged(self, index: int, chunk: torch.Tensor, staging: Sequence[torch.Tensor]) -> torch.Tensor:
        """Where group ``index``'s chunk is gathered before it is copied to ``chunk``'s device: its staging buffer."""
        if chunk.device == self.device:
            return chunk
        if len(staging) != len(self.groups):
            raise ChunkMismatchError(f"staging has {len(staging)} buffers for {len(self.groups)} groups")
        buffer = staging[index]
        needed = chunk.numel() * chunk.element_size()
        if (not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.device != self.device
                or not buffer.is_contiguous() or buffer.numel() < needed):
            raise ChunkMismatchError(f"staging for group {index} must be a contiguous uint8 tensor of at least "
                                     f"{needed} bytes on {self.device}")
        return buffer[:needed].view(chunk.dtype).view(chunk.shape)

    def unpack(
        self,
        chunks: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor | None = None,
        *,
        start: int = 0,
        end: int | None = None,
        state_indices: StateIndices = None,
        synchronize: bool = True,
    ) -> None:
        """Write chunk tensors (as :meth:`pack` returns them) into the caches at ``slot_mapping[start:end]``.

        Slots outside a group's cache, a slot named twice, and a chunk whose shape or dtype does
        not match its group raise before anything is written. Writes go through the caches' own
        storage, also for permuted (HND) views. With ``synchronize=False`` the copies may still
        run on the current stream when this returns (GPU caches): the caller records an event
        there, and reports the caches written (or refills pinned chunks) only once it completed.
        """
        call = self._check_call(slot_mapping, start, end, state_indices, distinct=True)
        chunk_list = list(chunks) if isinstance(chunks, Sequence) else None
        if chunk_list is None or len(chunk_list) != len(self.groups):
            count = len(chunk_list) if chunk_list is not None else type(chunks).__name__
            raise ChunkMismatchError(f"got {count} chunks for {len(self.groups)} groups; pass one per group")
        for index, (group, chunk) in enumerate(zip(self.groups, chunk_list, strict=True)):
            self._check_chunk(index, chunk, group.slots_shape(call.num_tokens, call.num_states), "chunk")
        copies = Staging(self.device)
        staged = [copies.on_device(chunk) for chunk in chunk_list]
        self._move(call, staged, scatter=True)
        if synchronize:  # the caller may refill its pinned chunks once we return: the uploads must be done
            copies.finish()

    def __repr__(self) -> str:
        groups = "; ".join(
            f"{group.kind.value} x{len(group.layer_names)}: {kernel}" + (f", {how}" if how else "")
            for group, kernel, how in zip(self.groups, self.kernels, self.lockstep, strict=True))
        return f"KVTransfer({len(self.groups)} groups on {self.device}: {groups})"

    def warm_up(self) -> None:
        """Compile every kernel this transfer launches, with its real copies' arguments, so that the first
        save or load compiles nothing: the first slots (and state slot) of every group are copied out
        and written back, their bytes unchanged. Run it before the caches hold anything of value."""
        slots = None
        if self._token_groups:
            slots = torch.arange(min(16, self._slot_limit), dtype=torch.int64)
        states = [0] if self._recurrent else None
        chunks = self.pack(slots, state_indices=states)
        self.unpack(chunks, slots, state_indices=states)

    # --- checks --------------------------------------------------------------------------
    def _check_call(self, slot_mapping: Any, start: int, end: int | None, state_indices: Any, *,
                    distinct: bool) -> CallSlots:
        slots = cpu_slots = None
        if self._token_groups:
            if slot_mapping is None:
                raise KVGroupsError("these groups hold token-indexed caches; pass a slot_mapping")
            slots, cpu_slots = self._check_slots(slot_mapping, start, end, distinct)
        indices = self._check_state_indices(state_indices, distinct)
        return CallSlots(slots=slots, cpu_slots=cpu_slots, state_indices=indices)

    def _check_slots(self, slot_mapping: Any, start: int, end: int | None,
                     distinct: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(slot_mapping, torch.Tensor):
            raise TypeError(f"slot_mapping must be an int64 tensor, got {type(slot_mapping).__name__}")
        if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
            raise TypeError(f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dtype} of shape "
                            f"{list(slot_mapping.shape)}")
        length = slot_mapping.shape[0]
        end = length if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= length):
            raise SlotMappingError(f"token range start={start}, end={end} must satisfy 0 <= start <= end <= {length}")
        # The common call (all of a CPU tensor, for CPU caches) runs no torch op: after a copy of tens of MiB
        # has evicted the CPU's caches, each costs microseconds.
        slots = slot_mapping if start == 0 and end == length else slot_mapping[start:end]
        cpu_slots = slots if slots.is_cpu else slots.cpu()
        # NumPy answers these questions on a few hundred slots in microseconds, torch in tens of them.
        values = cpu_slots.numpy()
        if values.size:
            # One reduction for both bounds: read as unsigned, a negative slot is beyond every limit.
            if int(values.view(np.uint64).max()) >= self._slot_limit:
                self._raise_out_of_range(cpu_slots)
            if distinct:
                ordered = np.sort(values)
                repeated = ordered[1:][ordered[1:] == ordered[:-1]]
                if repeated.size:
                    raise SlotMappingError(f"slot_mapping maps several tokens to slots "
                                           f"{np.unique(repeated)[:8].tolist()}; two tokens cannot own one slot")
        if self.device.type == "cuda" and slots.device.type == "cpu":
            # From pinned memory the upload is queued on the stream, not waited for.
            return cpu_slots.pin_memory().to(self.device, non_blocking=True), cpu_slots
        return slots if slots.device == self.device else slots.to(self.device), cpu_slots

    def _raise_out_of_range(self, cpu_slots: torch.Tensor) -> None:
        for index, group in enumerate(self.groups):
            if not group.token_indexed:
                continue
            capacity = group.geometry.num_slots
            bad = ((cpu_slots < 0) | (cpu_slots >= capacity)).nonzero().flatten()
            if bad.numel():
                shown = ", ".join(f"token {int(i)}: slot {int(cpu_slots[i])}" for i in bad[:5])
                raise SlotMappingError(
                    f"{bad.numel()} slot(s) outside group {index}'s [0, {capacity}) "
                    f"({group.num_blocks} blocks x {group.block_size}): {shown}"
                )

    def _check_state_indices(self, state_indices: Any, distinct: bool) -> torch.Tensor | None:
        if not self._recurrent:
            return None
        if state_indices is None:
            raise KVGroupsError(
                f"groups {self._recurrent} hold recurrent state, which is not token-indexed; pass state_indices "
                f"(one state slot per sequence)"
            )
        indices = torch.as_tensor(state_indices, dtype=torch.int64).flatten().cpu()
        for index in self._recurrent:
            slots = self.groups[index].num_blocks
            bad = indices[(indices < 0) | (indices >= slots)]
            if bad.numel():
                raise SlotMappingError(f"state_indices {bad.tolist()} outside group {index}'s [0, {slots}) state slots")
        if distinct and torch.unique(indices).numel() != indices.numel():
            raise SlotMappingError(f"state_indices {indices.tolist()} repeat a slot; two sequences cannot own one")
        return indices.to(self.device)

    def _check_chunk(self, index: int, chunk: Any, shape: torch.Size, what: str) -> None:
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

    # --- copies --------------------------------------------------------------------------
    def _move(self, call: CallSlots, chunks: list[torch.Tensor], scatter: bool) -> None:
        for copier, chunk in zip(self._copiers, chunks, strict=True):
            copier.copy(chunk, call, scatter)


def pack(groups: Groups, kv_caches: Mapping[str, Any], slot_mapping: torch.Tensor | None = None, *, start: int = 0,
         end: int | None = None, state_indices: StateIndices = None,
         out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """:meth:`KVTransfer.pack` on ``groups`` bound to ``kv_caches`` (bound again only when they changed)."""
    transfer = bound_transfer(_group_list(groups), kv_caches, KVTransfer)
    return transfer.pack(slot_mapping, start=start, end=end, state_indices=state_indices, out=out)


def unpack(groups: Groups, kv_caches: Mapping[str, Any], chunks: Sequence[torch.Tensor],
           slot_mapping: torch.Tensor | None = None, *, start: int = 0, end: int | None = None,
           state_indices: StateIndices = None) -> None:
    """:meth:`KVTransfer.unpack` on ``groups`` bound to ``kv_caches`` (bound again only when they changed)."""
    transfer = bound_transfer(_group_list(groups), kv_caches, KVTransfer)
    transfer.unpack(chunks, slot_mapping, start=start, end=end, state_indices=state_indices)
