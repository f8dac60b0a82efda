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

import threading
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
from kvgroups.datapath.call_checks import CallChecks
from kvgroups.datapath.descriptors import Launched, RingLease
from kvgroups.datapath.kernels import Copier, choose_kernel, state_copier, token_copier
from kvgroups.datapath.run_queue import RunCopier
from kvgroups.datapath.slots import CallSlots
from kvgroups.datapath.staging import Staging, gather_buffer
from kvgroups.errors import ChunkMismatchError, KVGroupsError

Groups = KVLayerGroupsManager | Sequence[KVLayerGroupInfo]
StateIndices = torch.Tensor | np.ndarray | Sequence[int] | int | None
SlotMapping = torch.Tensor | np.ndarray | None


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
        self._checks = CallChecks(self.groups, self.device)
        # Per group, its copier where it queues runs for one launch (the Triton kernels), else None.
        self._run_copiers: list[RunCopier | None] = [
            copier if isinstance(copier, RunCopier) else None for copier in self._copiers]
        # What a call changes, per thread (loads run on several): copies queued until launch, reused arrays.
        self._local = threading.local()
        self._shape_cache: dict[tuple[int, int], list[torch.Size]] = {}

    def pack(
        self,
        slot_mapping: SlotMapping = None,
        *,
        start: int = 0,
        end: int | None = None,
        state_indices: StateIndices = None,
        out: Sequence[torch.Tensor] | None = None,
        staging: Sequence[torch.Tensor] | None = None,
        synchronize: bool = True,
        defer: bool = False,
    ) -> list[torch.Tensor]:
        """Gather tokens ``slot_mapping[start:end]`` of every group into one chunk tensor per group.

        Token groups give ``[kv_size, num_layers, num_tokens, hidden_dim_size]`` in the group's dtype
        (``metadata.get_shapes(num_tokens)``); recurrent groups give the states of
        ``state_indices``, ``[1, num_layers, len(state_indices), state_elements]``. ``slot_mapping`` is
        an int64 tensor or NumPy array (slots already on the caches' device are used there, read back
        only to be checked). ``out``, one contiguous tensor per group on any device (pinned CPU memory
        for GPU caches, which the Triton kernels write directly), is filled instead of allocating on the
        caches' device; ``staging``, one uint8 buffer per group on the caches' device of at least its
        chunk's bytes, is where chunks of ``out`` that a kernel cannot address are gathered first (else
        a temporary buffer is). With ``synchronize=False`` copies to another device may still run on the
        current stream when this returns: the caller records an event there and waits for it before
        reading ``out``. ``defer=True`` (with ``out``) checks and queues the copies; :meth:`launch` then
        issues every queued pack of the calling thread in one launch per group, reading the slots then
        (they were checked when queued: the caller leaves them unchanged until it launches). Everything
        is checked before any copy; the caches are only read.
        """
        call = self._checks.call(slot_mapping, start, end, state_indices, distinct=False)
        shapes = self._shapes(call.num_tokens, call.num_states)
        if out is None:
            if defer:
                raise KVGroupsError("a deferred pack fills the chunks it is given: pass out=")
            results = [self._pool.empty(shape, group.dtype) for group, shape in zip(self.groups, shapes, strict=True)]
            self._queue(call, results, scatter=False)
            self.launch(scatter=False).release(synchronize=False)
            return results
        outputs = list(out)
        if len(outputs) != len(self.groups):
            raise ChunkMismatchError(f"out has {len(outputs)} tensors for {len(self.groups)} groups")
        for index, (chunk, shape) in enumerate(zip(outputs, shapes, strict=True)):
            self._checks.chunk(index, chunk, shape, "out")
        buffers = [chunk if self._direct(index, chunk)
                   else gather_buffer(self.device, index, chunk, staging, len(self.groups))
                   for index, chunk in enumerate(outputs)]
        self._queue(call, buffers, scatter=False)
        staged = [(chunk, buffer) for chunk, buffer in zip(outputs, buffers, strict=True) if buffer is not chunk]
        if defer and not staged:  # else gathered now (a deferred buffer could be overwritten by the next call)
            return outputs
        launched = self.launch(scatter=False)
        if staged:
            copies = Staging(self.device)
            for chunk, buffer in staged:
                copies.copy(chunk, buffer)
            launched.asynchronous = copies.asynchronous
        launched.release(synchronize and not defer)
        return outputs

    def _shapes(self, num_tokens: int, num_states: int) -> list[torch.Size]:
        """Every group's chunk shape for a call of ``num_tokens`` slots and ``num_states`` states (kept by size)."""
        shapes = self._shape_cache.get((num_tokens, num_states))
        if shapes is None:
            if len(self._shape_cache) > 64:  # calls of many sizes (partial chunks): start again
                self._shape_cache.clear()
            shapes = self._shape_cache[num_tokens, num_states] = [
                group.slots_shape(num_tokens, num_states) for group in self.groups]
        return shapes

    def _direct(self, index: int, chunk: torch.Tensor) -> bool:
        """Whether group ``index``'s kernel reads or writes ``chunk`` where it is: on the caches' device, or (the
        Triton kernels, by address) in pinned host memory."""
        if chunk.device == self.device:
            return True
        return self._run_copiers[index] is not None and self.device.type == "cuda" and chunk.is_pinned()

    def unpack(
        self,
        chunks: Sequence[torch.Tensor],
        slot_mapping: SlotMapping = None,
        *,
        start: int = 0,
        end: int | None = None,
        rows: np.ndarray | None = None,
        state_indices: StateIndices = None,
        synchronize: bool = True,
        defer: bool = False,
    ) -> None:
        """Write chunk tensors (as :meth:`pack` returns them) into the caches at ``slot_mapping[start:end]``.

        ``rows``, for token groups: the chunk row each slot takes (a NumPy int64 array as long as the
        slots, no row twice; a chunk may then hold any number of rows beyond the largest), else rows
        0, 1, ... Slots outside a group's cache, a slot named twice, and a chunk whose shape or dtype
        does not match its group raise before anything is written. Writes go through the caches' own
        storage, also for permuted (HND) views. With ``synchronize=False`` the copies may still run on
        the current stream when this returns (GPU caches): the caller records an event there, and
        reports the caches written (or refills pinned chunks) only once it completed. ``defer=True``
        queues the copies for :meth:`launch`; as with a deferred pack, the slots, rows and chunks are
        read when it launches, and must not change before.
        """
        call = self._checks.call(slot_mapping, start, end, state_indices, distinct=True)
        chunk_list = list(chunks) if isinstance(chunks, Sequence) else None
        if chunk_list is None or len(chunk_list) != len(self.groups):
            count = len(chunk_list) if chunk_list is not None else type(chunks).__name__
            raise ChunkMismatchError(f"got {count} chunks for {len(self.groups)} groups; pass one per group")
        needed = None if rows is None else self._checks.rows(rows, call.num_tokens)
        for index, (group, chunk) in enumerate(zip(self.groups, chunk_list, strict=True)):
            chunk_rows = call.num_tokens
            if needed is not None and group.token_indexed and isinstance(chunk, torch.Tensor) and chunk.dim() == 4:
                chunk_rows = chunk.shape[2]  # any number of rows that holds every row named
                if chunk_rows < needed:
                    raise ChunkMismatchError(f"chunk for group {index} has {chunk_rows} rows; "
                                             f"rows names row {needed - 1}")
            self._checks.chunk(index, chunk, group.slots_shape(chunk_rows, call.num_states), "chunk")
        copies = Staging(self.device)
        staged = [chunk if self._direct(index, chunk) else copies.on_device(chunk)
                  for index, chunk in enumerate(chunk_list)]
        self._queue(call, staged, scatter=True, rows=rows)
        if defer and copies.uploads == 0:
            return
        # At once when a chunk was uploaded first: the upload is freed when this returns.
        launched = self.launch(scatter=True)
        launched.asynchronous |= copies.asynchronous
        # The caller may refill its pinned chunks once we return: with synchronize, the copies are done.
        launched.release(synchronize and not defer)

    def launch(self, *, scatter: bool) -> Launched:
        """Issue every queued copy of one direction: one launch per group for the Triton kernels. The caller
        releases what it returns once the copies completed (:meth:`Launched.release_after`)."""
        leases: list[RingLease] = []
        pending = self._pending(scatter)
        try:
            for run_copier in self._run_copiers:
                if run_copier is not None and (lease := run_copier.launch_queued(scatter)) is not None:
                    leases.append(lease)
            for index, chunk, call, rows in pending:
                self._copy_slowly(index, chunk, call, rows, scatter)
        except BaseException:  # nothing queued outlives a failed launch (its chunks may be reused at once)
            for run_copier in self._run_copiers:
                if run_copier is not None:
                    run_copier.queue(scatter).clear()
            Launched(self.device, leases, asynchronous=False).release(synchronize=True)
            raise
        finally:
            pending.clear()
        return Launched(self.device, leases, asynchronous=False)

    @property
    def addresses_pinned_chunks(self) -> bool:
        """Whether every group's kernel reads and writes chunks in pinned host memory itself (no staging)."""
        return all(copier is not None for copier in self._run_copiers)

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
        if self._checks.slot_limit:
            slots = torch.arange(min(16, self._checks.slot_limit), dtype=torch.int64)
        states = [0] if any(not group.token_indexed for group in self.groups) else None
        chunks = self.pack(slots, state_indices=states)
        self.unpack(chunks, slots, state_indices=states)

    def _pending(self, scatter: bool) -> list[tuple[int, torch.Tensor, CallSlots, np.ndarray | None]]:
        """This thread's copies of one direction by kernels without run queues, until :meth:`launch`."""
        pending: dict[bool, list[Any]] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = {False: [], True: []}
        return pending[scatter]

    # --- copies --------------------------------------------------------------------------
    def _queue(self, call: CallSlots, chunks: list[torch.Tensor], scatter: bool,
               rows: np.ndarray | None = None) -> None:
        """Queue one call's copies: a run copier's into its run queue, by address; any other's until :meth:`launch`."""
        for index, (run_copier, chunk) in enumerate(zip(self._run_copiers, chunks, strict=True)):
            if run_copier is None:
                self._pending(scatter).append((index, chunk, call, rows))
                continue
            group = self.groups[index]
            if group.token_indexed:
                if call.slot_values is not None:
                    run_copier.queue(scatter).add(chunk, chunk.shape[2], call.slot_values, rows)
            elif call.state_values is not None:
                run_copier.queue(scatter).add(chunk, call.num_states, call.state_values)

    def _copy_slowly(self, index: int, chunk: torch.Tensor, call: CallSlots, rows: np.ndarray | None,
                     scatter: bool) -> None:
        """A copy by a kernel without run queues (numba, torch): ``rows`` taken out of the chunk first."""
        if rows is not None and self.groups[index].token_indexed:
            chunk = chunk.index_select(2, torch.from_numpy(rows).to(chunk.device))
        copier = self._copiers[index]
        assert not isinstance(copier, RunCopier)
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
