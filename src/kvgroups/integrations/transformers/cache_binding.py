"""A transformers model's cache as kvgroups groups: read once, then chunks out of a cache and a cache out of chunks.

:class:`CacheBinding` owns everything between a transformers cache and the chunk store: the parts
its layers are read as (:mod:`.cache_parts`), their groups and ``LMCacheMetadata`` (from one probe
forward, built once), the transfers that pack a forward's cache into chunks, and the restore of a
loaded prefix into a fresh cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.group_keys import layer_key
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.datapath.transfer import KVTransfer
from kvgroups.errors import KVGroupsError, UnsupportedCacheError
from kvgroups.integrations.transformers.cache_parts import (
    Part,
    PartRole,
    current_value,
    empty_value,
    install,
    read_parts,
)
from kvgroups.store.chunks.prefixes import LoadedEntries


class BoundCache:
    """One forward's cache bound for packing: per group, its transfer and the first token it holds.

    Bound once per forward; every chunk that forward completes is packed from the same tensors. A
    part holds its latest tokens, so a sliding one may no longer hold a chunk's first ones.
    """

    def __init__(self, groups: list[tuple[KVLayerGroupInfo, KVTransfer]], computed: int) -> None:
        # A token group's layers are one block each (batch 1): its block size is the slots it holds, the
        # latest ones (compressed rows: every row so far).
        self._groups = [(group, transfer, group.spec.slot_range(computed, computed)[0] - group.block_size
                         if group.token_indexed else 0) for group, transfer in groups]

    def pack(self, start: int, end: int) -> list[torch.Tensor]:
        """The chunk of tokens ``[start, end)`` of every group; recurrent groups give their state now,
        so the chunk must end where the cache does. Tokens a sliding part no longer holds are zeros
        (a sliding group never reads them back), as is the room a chunk of compressed rows has beyond
        the rows it completed."""
        chunks = []
        for group, transfer, first_held in self._groups:
            if not group.token_indexed:
                chunks.append(transfer.pack(state_indices=[0])[0])
                continue
            low, high = group.spec.slot_range(start, end)
            available = max(low, first_held)
            if available == low and high - low == group.spec.chunk_slots(end - start):
                # Slots on the host: the data path plans a call there and never reads back a device tensor.
                slots = np.arange(low - first_held, high - first_held, dtype=np.int64)
                chunks.append(transfer.pack(slots)[0])
                continue
            whole = torch.zeros(group.chunk_shape(end - start), dtype=group.dtype, device=transfer.device)
            if high > available:
                slots = np.arange(available - first_held, high - first_held, dtype=np.int64)
                whole[:, :, available - low:high - low] = transfer.pack(slots)[0]
            chunks.append(whole)
        return chunks


def _probe(model: Any, device: torch.device) -> list[Part]:
    """The parts of the cache a one-token forward leaves, once the cache is known to be all of the state."""
    probe = DynamicCache(config=model.config)
    layers = len(probe.layers)
    one = torch.zeros(1, 1, dtype=torch.int64, device=device)
    with torch.no_grad():
        output = model(input_ids=one, cache=probe, use_cache=True, position_ids=one, logits_to_keep=1)
    returned = getattr(output, "cache", None)
    if id(returned) != id(probe):  # (an identity check mypy does not narrow on)
        what = "no cache" if returned is None else f"a {type(returned).__name__} of its own"
        raise UnsupportedCacheError(f"the model's forward returns {what}, not the DynamicCache it was given: its "
                                    f"state is kept where kvgroups cannot read it")
    if len(probe.layers) != layers:
        raise UnsupportedCacheError(f"the model's forward grew its cache from {layers} to {len(probe.layers)} layers "
                                    f"(passes over shared layers keep caches of their own); a fresh cache cannot "
                                    f"hold them")
    parts = read_parts(probe, model)
    for part in (part for part in parts if part.token_indexed):
        value = current_value(part, probe)
        rows = (value[0] if isinstance(value, tuple) else value).shape[-2]  # [..., tokens, width]
        first, last = part.spec.slot_range(0, 1)  # a row per token; no compressed row yet
        if rows != last - first:
            raise UnsupportedCacheError(f"cache layer {part.layer_index} holds {rows} positions after a one-token "
                                        f"forward (positions of its own before the tokens); kvgroups stores one "
                                        f"row per token")
    return parts


class CacheBinding:
    """The parts, groups and metadata of a transformers model's cache, read from one probe forward.

    ``groups`` are the metadata's groups in the form one chunk of ``chunk_size`` tokens takes;
    ``all_recurrent`` says the cache holds states only, ``keeps_every_token`` that every part keeps
    every token (so a prefill can run in one forward and be packed after it).
    """

    def __init__(self, model: Any, chunk_size: int, model_name: str) -> None:
        self.config = model.config
        self.device = next(model.parameters()).device
        self.parts = _probe(model, self.device)
        self.specs: dict[str, LayerCacheSpec] = {part.name: part.spec for part in self.parts}
        self.all_recurrent = not any(part.token_indexed for part in self.parts)
        self.keeps_every_token = all(part.spec.keeps_every_token for part in self.parts)
        # The groups as they look holding one chunk, built on meta tensors.
        template = {part.name: empty_value(part, part.spec.chunk_slots(chunk_size), torch.device("meta"))
                    for part in self.parts}
        manager = KVLayerGroupsManager()
        manager.build_kv_layer_groups(template, self.specs, layout={
            part.name: part.layout for part in self.parts if part.layout is not None})
        self.metadata = LMCacheMetadata.for_groups(manager.kv_layer_groups, model_name=model_name,
                                                   chunk_size=chunk_size)
        self.groups = list(self.metadata.kv_layer_groups_manager.kv_layer_groups)
        by_name = {part.name: part for part in self.parts}
        self.group_parts: list[list[Part]] = [[by_name[name] for name in group.layer_names] for group in self.groups]

    def _transfer(self, group_index: int, values: dict[str, Any]) -> tuple[KVLayerGroupInfo, KVTransfer]:
        """Group ``group_index`` over ``values`` (its parts' tensors now), bound for copies."""
        template = self.groups[group_index]
        try:
            key, _ = layer_key(values[template.layer_names[0]], template.layout, template.spec)
            group = KVLayerGroupInfo(template.layer_names, template.layer_indices, key.shape, key.dtype, key.layout,
                                     key.spec, value_head_size=key.value_head_size)
            return group, KVTransfer([group], values)
        except KVGroupsError as error:
            raise UnsupportedCacheError(f"the cache's layers no longer group as they did: {error}") from None

    def bind(self, cache: Any, computed: int) -> BoundCache:
        """``cache``, holding ``computed`` tokens after a forward, bound for packing its chunks."""
        values = {part.name: current_value(part, cache) for part in self.parts}
        return BoundCache([self._transfer(index, values) for index in range(len(self.groups))], computed)

    def restore(self, loaded: LoadedEntries, capacity_tokens: int = 0) -> Any:
        """A fresh transformers cache holding the loaded prefix, as if it had been computed: each entry
        copied once, straight into the cache's tensors. Layers that keep every token get room for
        ``capacity_tokens`` in all, so that the forward computing the rest writes it in place
        (:class:`~.reserved_layers.ReservedDynamicLayer`) rather than copying the prefix again."""
        cache = DynamicCache(config=self.config)
        boundary, chunk_size = loaded.num_tokens, self.metadata.chunk_size
        values: dict[str, Any] = {}
        for group_index, parts in enumerate(self.group_parts):
            entries = loaded.chunks(group_index)
            if not parts[0].token_indexed:
                fresh = {part.name: empty_value(part, 0, self.device) for part in parts}
                _, transfer = self._transfer(group_index, fresh)
                for _, state in entries:  # the one state at the boundary
                    transfer.unpack([state.to(self.device).contiguous()], state_indices=[0])
            else:
                # What the layers keep at the boundary: every token (or compressed row), or a sliding layer's window.
                spec = parts[0].spec
                start, end = spec.slot_range(*spec.tokens_needed(boundary))
                # Room only where install() hands the tensors to a layer as they are: the keys and values
                # of a plain DynamicLayer (the one class whose updates write into it, ReservedDynamicLayer's).
                reserve = (capacity_tokens > end and spec.keeps_every_token
                           and all(part.role is PartRole.KV and type(cache.layers[part.layer_index]) is DynamicLayer
                                   for part in parts))
                room = capacity_tokens if reserve else end - start
                fresh = {part.name: empty_value(part, room, self.device) for part in parts}
                _, transfer = self._transfer(group_index, fresh)
                for chunk, tensor in entries:
                    first, last = spec.slot_range(chunk * chunk_size, (chunk + 1) * chunk_size)
                    low, high = max(first, start), min(last, end)
                    if low >= high:  # a chunk that completed no compressed row, or left the window
                        continue
                    whole = (low, high) == (first, first + tensor.shape[2])
                    rows = tensor if whole else tensor[:, :, low - first:high - first].contiguous()
                    transfer.unpack([rows.to(self.device)], np.arange(low - start, high - start, dtype=np.int64))
            values.update(fresh)
        install(self.parts, values, cache, boundary)
        return cache
