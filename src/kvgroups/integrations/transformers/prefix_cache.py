"""``PrefixCache``: a prompt that shares a stored prefix skips that prefix's prefill, hybrids included.

``prefill`` looks up the longest stored prefix every group can serve (``KVChunkStore.lookup``),
builds a fresh transformers cache from it, computes the rest with explicit position ids (one chunk
per forward when a recurrent state must exist at every chunk boundary or a sliding layer would
drop a chunk's tokens before they are read; in one forward otherwise) and saves every new full
chunk. The answer is the one
recomputing gives: the checked model types continue a restored cache exactly (to float noise).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.layouts import KVLayout
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.datapath.kernels import warm_up
from kvgroups.datapath.transfer import KVTransfer
from kvgroups.errors import KVGroupsError, UnsupportedCacheError
from kvgroups.integrations.transformers.cache_parts import (
    Part,
    current_value,
    describe,
    empty_value,
    install,
)
from kvgroups.integrations.transformers.support import check_supported, model_identity
from kvgroups.store import KVChunkStore, LoadedPrefix
from kvgroups.store.keys import token_array
from kvgroups.store.urls import StoreArg

Progress = Callable[[int, int], None]  # (tokens done, tokens in all)


@dataclass(frozen=True)
class PrefillResult:
    """A prompt's cache and its last position's logits; how many tokens were reused and computed."""

    cache: Any
    logits: torch.Tensor  # [vocab_size], last position
    reused_tokens: int
    computed_tokens: int
    seconds: float


# A forward's cache bound for packing: per group, its transfer and the first token it holds.
_Bound = list[tuple[KVLayerGroupInfo, KVTransfer, int]]


def _prompt(input_ids: Any) -> torch.Tensor:
    """``input_ids`` as a 1-D int64 tensor; a batch of more than one raises."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise KVGroupsError(f"PrefixCache serves one sequence at a time; got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.numel() == 0:
        raise KVGroupsError(f"input_ids must be a non-empty [1, seq] or [seq] tensor of token ids, got "
                            f"{ids.dtype} {list(ids.shape)}")
    return ids.to(torch.int64)


class PrefixCache:
    """Prefix reuse for a transformers causal LM, through a chunk store (URL(s) or a byte store)."""

    def __init__(self, model: Any, store: StoreArg, *, chunk_size: int = 256, salt: str | bytes = "",
                 max_pending: int = 64) -> None:
        check_supported(model)
        self.model = model
        self.chunk_size = chunk_size
        self.device = next(model.parameters()).device
        warm_up(self.device)  # the data path's kernels compile now, not inside the first request
        probe = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.int64, device=self.device), cache=probe, use_cache=True,
                  position_ids=torch.zeros(1, 1, dtype=torch.int64, device=self.device), logits_to_keep=1)
        self.parts = describe(probe)
        self.all_recurrent = not any(part.token_indexed for part in self.parts)
        self.keeps_every_token = all(part.token_indexed and part.kept_tokens is None for part in self.parts)
        self.specs: dict[str, LayerCacheSpec] = {part.name: part.spec for part in self.parts}
        self.layouts = {part.name: part.layout for part in self.parts if part.layout is not None}
        self.metadata = self._metadata(model_identity(model))
        self.groups = list(self.metadata.kv_layer_groups_manager.kv_layer_groups)
        by_name = {part.name: part for part in self.parts}
        self.group_parts = [[by_name[name] for name in group.layer_names] for group in self.groups]
        self.chunk_store = KVChunkStore(self.metadata, store, salt=salt,
                                        max_pending=max_pending)
        # The latest prefill's result (generate() runs one): what it reused and computed.
        self.last_prefill: PrefillResult | None = None

    def _metadata(self, model_name: str) -> LMCacheMetadata:
        """Groups of the parts as they look holding one chunk (meta tensors), and their metadata."""
        chunk = self.chunk_size
        template = {part.name: empty_value(part, chunk, torch.device("meta")) for part in self.parts}
        token_parts = [part for part in self.parts if part.token_indexed]
        use_mla = any(part.layout is KVLayout.MLA for part in token_parts)
        first = token_parts[0] if token_parts else self.parts[0]
        heads, head_size = (first.shape if first.role == "kv" else (1, first.shape[-1])) if token_parts \
            else (1, int(torch.Size(first.shape).numel()))
        metadata = LMCacheMetadata(
            model_name=model_name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=first.dtype, kv_shape=(len(self.parts), 1 if use_mla else 2, chunk, heads, head_size),
            use_mla=use_mla, chunk_size=chunk,
        )
        metadata.kv_layer_groups_manager.build_kv_layer_groups(template, self.specs, layout=self.layouts)
        return metadata

    def _regroup(self, values: dict[str, Any]) -> KVLayerGroupsManager:
        """Groups over this step's tensors; they must be the template's groups, layer for layer."""
        manager = KVLayerGroupsManager()
        manager.build_kv_layer_groups(values, {name: self.specs[name] for name in values},
                                      layout={name: self.layouts[name] for name in values if name in self.layouts})
        expected = [group.layer_names for group in self.groups if set(group.layer_names) <= values.keys()]
        if [group.layer_names for group in manager.kv_layer_groups] != expected:
            raise UnsupportedCacheError("the cache's layers group differently from one forward to the next")
        return manager

    # --- chunks out of a cache, and a cache out of chunks ---------------------------------
    def _bind(self, cache: Any, computed: int) -> _Bound:
        """Every group of a cache of ``computed`` tokens, bound for packing, with the first token it
        holds (a part holds its latest tokens; a sliding one may no longer hold the first ones).

        Once per forward: every chunk that forward completes is packed from the same tensors.
        """
        values = {part.name: current_value(part, cache) for part in self.parts}
        manager = self._regroup(values)
        # A token group's layers are one block each (batch 1): its block size is the tokens it holds.
        return [
            (group, KVTransfer([group], values), computed - group.block_size if group.token_indexed else 0)
            for group in manager.kv_layer_groups
        ]

    def _pack(self, bound: _Bound, start: int, end: int) -> list[torch.Tensor]:
        """The chunk of tokens ``[start, end)`` of every group of a cache :meth:`_bind` bound.

        Recurrent groups give their state now, so the chunk must end where the cache does.
        """
        chunks = []
        for group, transfer, first_held in bound:
            if not group.token_indexed:
                chunks.append(transfer.pack(state_indices=[0])[0])
                continue
            available = max(start, first_held)
            packed = transfer.pack(torch.arange(available - first_held, end - first_held, device=self.device))[0]
            if available > start:
                whole = torch.zeros(group.chunk_shape(end - start), dtype=group.dtype, device=packed.device)
                whole[:, :, available - start:] = packed
                packed = whole
            chunks.append(packed)
        return chunks

    def _restore(self, loaded: LoadedPrefix) -> Any:
        """A fresh transformers cache holding the loaded prefix, as if it had been computed."""
        cache = DynamicCache(config=self.model.config)
        boundary = loaded.num_tokens
        values: dict[str, Any] = {}
        for prefix in loaded.groups:
            parts = self.group_parts[prefix.group_index]
            stored = prefix.tensor.to(self.device)
            if not parts[0].token_indexed:
                fresh = {part.name: empty_value(part, 0, self.device) for part in parts}
                KVTransfer(self._regroup(fresh), fresh).unpack([stored.contiguous()], state_indices=[0])
            else:
                kept = parts[0].kept_tokens
                count = boundary - prefix.first_token if kept is None else min(kept, boundary)
                fresh = {part.name: empty_value(part, count, self.device) for part in parts}
                rows = stored[:, :, stored.shape[2] - count:].contiguous()
                KVTransfer(self._regroup(fresh), fresh).unpack([rows], torch.arange(count, device=self.device))
            values.update(fresh)
        install(self.parts, values, cache, boundary)
        return cache

    # --- the public calls -----------------------------------------------------------------
    def prefill(self, input_ids: Any, *, progress: Progress | None = None) -> PrefillResult:
        """The cache and last-position logits of ``input_ids`` (batch 1), reusing the longest stored prefix."""
        begin = time.perf_counter()
        prompt = _prompt(input_ids)
        tokens = token_array(prompt)  # before the move: no copy back from the device
        ids = prompt.to(self.device)
        total, chunk = len(tokens), self.chunk_size
        keys = self.chunk_store.keys(tokens)
        # At least one token is computed, for the logits.
        limit = (total - 1) // chunk
        boundary = self.chunk_store.lookup(None, keys=keys[:limit]) if limit else 0
        loaded = self.chunk_store.load(None, boundary, keys=keys) if boundary else LoadedPrefix(num_tokens=0)
        cache = self._restore(loaded) if loaded.num_tokens else DynamicCache(config=self.model.config)
        position = loaded.num_tokens
        logits = None
        with torch.no_grad():
            while position < total:
                # Layers that keep every token can take the rest in one forward and be packed after
                # it; a recurrent state exists only at the end of a forward, and a sliding layer drops
                # tokens, so models with either compute one chunk per forward.
                end = total if self.keeps_every_token else min(total, (position // chunk + 1) * chunk)
                output = self.model(
                    input_ids=ids[None, position:end], cache=cache, use_cache=True, logits_to_keep=1,
                    position_ids=torch.arange(position, end, device=self.device)[None],
                )
                cache, logits = output.cache, output.logits
                completed = range(position // chunk, end // chunk)
                bound = self._bind(cache, end) if completed else []
                for index in completed:
                    start = index * chunk
                    self.chunk_store.save(tokens, index, self._pack(bound, start, start + chunk), keys=keys)
                position = end
                if progress is not None:
                    progress(position, total)
        assert logits is not None  # at least one token is always computed
        self.last_prefill = PrefillResult(cache=cache, logits=logits[0, -1], reused_tokens=loaded.num_tokens,
                                          computed_tokens=total - loaded.num_tokens,
                                          seconds=time.perf_counter() - begin)
        return self.last_prefill

    def generate(self, input_ids: Any, max_new_tokens: int = 32, **kwargs: Any) -> torch.Tensor:
        """``model.generate`` after a reusing prefill of all but the last prompt token; greedy by default.

        Returns what ``model.generate`` returns: the prompt followed by the new tokens.
        """
        ids = _prompt(input_ids).to(self.device)
        progress = kwargs.pop("progress", None)
        kwargs.setdefault("do_sample", False)
        if len(ids) < 2:
            return self.model.generate(ids[None], max_new_tokens=max_new_tokens, **kwargs)  # type: ignore[no-any-return]
        # generate() in transformers 5 takes the cache as ``cache``.
        result = self.prefill(ids[:-1], progress=progress)
        if self.all_recurrent:
            # A cache of only recurrent layers cannot say its length, so generate would feed the
            # whole prompt on top of the state: hand it only the token that is not cached.
            output = self.model.generate(ids[None, -1:], cache=result.cache, max_new_tokens=max_new_tokens, **kwargs)
            return torch.cat([ids[None, :-1], output], dim=1)
        return self.model.generate(ids[None], cache=result.cache,  # type: ignore[no-any-return]
                                   max_new_tokens=max_new_tokens, **kwargs)

    def flush(self) -> None:
        """Wait until every chunk saved so far is in the store."""
        self.chunk_store.flush()

    def close(self) -> None:
        self.chunk_store.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["Part", "PrefillResult", "PrefixCache"]
