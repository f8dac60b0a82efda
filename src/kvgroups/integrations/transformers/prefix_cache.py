"""``PrefixCache``: a prompt that shares a stored prefix skips that prefix's prefill, hybrids included.

``prefill`` reads as the request flows: look up the longest stored prefix every group can serve
(``KVChunkStore.lookup``), load it and restore a fresh transformers cache from it
(:class:`~.cache_binding.CacheBinding`), compute the rest with explicit position ids, and save
every new full chunk. The answer is the one recomputing gives: the checked model types continue a
restored cache exactly (to float noise).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import DynamicCache, StoppingCriteriaList

from kvgroups.datapath.kernels import warm_up
from kvgroups.errors import KVGroupsError
from kvgroups.integrations.transformers.cache_binding import CacheBinding
from kvgroups.integrations.transformers.reply_saves import ReplySaves
from kvgroups.integrations.transformers.restore_check import (
    RestoreCheck,
    check_enabled,
    checked,
    continue_forward,
    continue_generate,
    feeds_last_only,
    needs_check,
)
from kvgroups.integrations.transformers.support import check_supported, model_identity
from kvgroups.store import KVChunkStore, LoadedEntries, StoreSecret
from kvgroups.store.backends.urls import StoreArg
from kvgroups.store.chunks.chunk_store import DEFAULT_MAX_PENDING_BYTES
from kvgroups.store.entries.keys import token_array
from kvgroups.store.metrics.counters import StoreMetrics

logger = logging.getLogger(__name__)
Progress = Callable[[int, int], None]  # (tokens done, tokens in all)


@dataclass(frozen=True)
class PrefillResult:
    """A prompt's cache and its last position's logits; how many tokens were reused and computed."""

    cache: Any
    logits: torch.Tensor  # [vocab_size], last position
    reused_tokens: int
    computed_tokens: int
    seconds: float


# generate()'s arguments that turn on assisted decoding (transformers' speculative decoding).
ASSISTED_ARGUMENTS = ("prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit")


def _assisted(model: Any, kwargs: dict[str, Any]) -> str:
    """The assisted-decoding argument ``generate`` would run with (from its arguments, the generation config
    passed, or the model's), or ""."""
    configs = [kwargs.get("generation_config"), getattr(model, "generation_config", None)]
    return next((name for name in ASSISTED_ARGUMENTS
                 if kwargs.get(name) is not None or any(getattr(config, name, None) is not None for config in configs)),
                "")


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
    """Prefix reuse for a transformers causal LM through a chunk store.

    Args:
        model: a transformers causal LM (batch 1) of a model type whose reuse was verified
            (``VERIFIED_MODEL_TYPES``); its weights, name and transformers version name its chunks.
        store: a store URL (``file:///var/cache/kv``, ``redis://host:6379/0``, ...), a list of
            URLs (tiers, fastest first) or a :class:`~kvgroups.store.ByteStore`.
        chunk_size: tokens per stored chunk; a prompt reuses whole chunks.
        salt: the tenant's salt: chunks saved under one salt are never served under another.
        secret: the deployment's secret (None: ``$KVGROUPS_STORE_SECRET`` when set): keyed keys and
            a MAC on every entry, so nobody without it can confirm a prompt or plant KV.
        encrypt: also encrypt every entry (AES-256-GCM; needs a secret).
        max_pending_bytes: bytes of saves the background writer may hold before it drops new ones.
        restore_check: on a transformers version the sweep never verified, check before the first hit
            that a restored prefix continues as a computed one (:mod:`.restore_check`), and serve no hit
            if it does not. None: on unless ``$KVGROUPS_RESTORE_CHECK=0``; False: for operators who
            verified that version themselves. A verified version is never checked.

    Raises:
        UnsupportedModelError: the model type is refused, or its reuse was never checked.
        UnsupportedCacheError: the model's cache holds something kvgroups cannot store and restore.
        KVGroupsError: a bad store URL or argument.
    """

    def __init__(self, model: Any, store: StoreArg, *, chunk_size: int = 256, salt: str | bytes = "",
                 secret: str | bytes | StoreSecret | None = None, encrypt: bool = False,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, restore_check: bool | None = None) -> None:
        check_supported(model)
        # The version read now, not at import: whether this model's hits wait for a check.
        self._check_restores = needs_check(transformers.__version__) and check_enabled(restore_check)
        self.model = model
        self.chunk_size = chunk_size
        self.device = next(model.parameters()).device
        warm_up(self.device)  # the data path's kernels compile now, not inside the first request
        self.binding = CacheBinding(model, chunk_size, model_identity(model))
        self.metadata = self.binding.metadata
        self.groups = self.binding.groups
        self.chunk_store = KVChunkStore(self.metadata, store, salt=salt, secret=secret, encrypt=encrypt,
                                        max_pending_bytes=max_pending_bytes)
        # The latest prefill's result (generate() runs one): what it reused and computed.
        self.last_prefill: PrefillResult | None = None
        # The restore check, once run (None: not yet, or not needed on a verified version).
        self.restore_check: RestoreCheck | None = None
        self.reply_chunks_saved = 0  # chunks of generated tokens saved by generate()

    # --- the public calls -----------------------------------------------------------------
    def prefill(self, input_ids: Any, *, progress: Progress | None = None) -> PrefillResult:
        """The cache and last-position logits of ``input_ids``, reusing the longest stored prefix.

        Args:
            input_ids: one prompt, ``[seq]`` or ``[1, seq]`` token ids.
            progress: called with (tokens done, tokens in all) after each forward.

        Returns:
            A :class:`PrefillResult`: the transformers cache (to continue from), the logits of the
            last position, the tokens reused and computed, and the seconds it took.

        Raises:
            KVGroupsError: a batch of more than one sequence, or ids that are no token ids. A store
            that is down, full or corrupt costs reused tokens, never an exception.
        """
        begin = time.perf_counter()
        prompt = _prompt(input_ids)
        tokens = token_array(prompt)  # before the move: no copy back from the device
        ids = prompt.to(self.device)
        total, chunk = len(tokens), self.chunk_size
        keys = self.chunk_store.keys(tokens)
        # Look up and load: at least one token is computed, for the logits.
        limit = (total - 1) // chunk if self._hits_possible else 0
        boundary = self.chunk_store.lookup(None, keys=keys[:limit]) if limit else 0
        if boundary and not self._hits_checked():
            boundary = 0
        loaded = self.chunk_store.load_entries(None, boundary, keys=keys) if boundary else \
            LoadedEntries(num_tokens=0, entries={})
        # Restore, with room for the prompt's other tokens: the forwards computing them write them in place.
        cache = self.binding.restore(loaded, capacity_tokens=total) if loaded.num_tokens else \
            DynamicCache(config=self.model.config)
        position = loaded.num_tokens
        logits = None
        with torch.no_grad():
            while position < total:
                # Compute. Layers that keep every token take the rest in one forward and are packed
                # after it; a recurrent state exists only at the end of a forward, and a sliding layer
                # drops tokens, so models with either compute one chunk per forward.
                end = total if self.binding.keeps_every_token else min(total, (position // chunk + 1) * chunk)
                output = continue_forward(self.model, ids[position:end], cache, position)
                cache, logits = output.cache, output.logits
                # Save every chunk this forward completed.
                completed = range(position // chunk, end // chunk)
                if completed:
                    bound = self.binding.bind(cache, end)
                    for index in completed:
                        self.chunk_store.save(tokens, index, bound.pack(index * chunk, (index + 1) * chunk),
                                              keys=keys)
                position = end
                if progress is not None:
                    progress(position, total)
        if logits is None:  # unreachable: limit leaves at least one token to compute
            raise KVGroupsError("prefill computed no token")
        self.last_prefill = PrefillResult(cache=cache, logits=logits[0, -1], reused_tokens=loaded.num_tokens,
                                          computed_tokens=total - loaded.num_tokens,
                                          seconds=time.perf_counter() - begin)
        return self.last_prefill

    def generate(self, input_ids: Any, max_new_tokens: int = 32, *, save_reply: bool = True,
                 **kwargs: Any) -> torch.Tensor:
        """``model.generate`` after a reusing prefill of all but the last prompt token; greedy by default.

        ``save_reply``: save the full chunks the reply fills as they are generated (a conversation's next
        turn, the prompt, the reply and a new message, then loads them); ``reply_chunks_saved`` counts them.
        Returns what ``model.generate`` returns: the prompt followed by the new tokens.
        """
        ids = _prompt(input_ids).to(self.device)
        progress = kwargs.pop("progress", None)
        kwargs.setdefault("do_sample", False)
        assisted = _assisted(self.model, kwargs)
        if assisted:
            # transformers' assisted decoding continuing a cache it is handed answers otherwise than without one
            # (5.25: prompt lookup's first token already differs): no reuse, and the answer stays transformers'.
            logger.warning("PrefixCache.generate: %s (assisted decoding) is run without prefix reuse: transformers' "
                           "assisted decoding does not continue a given cache as it computes one", assisted)
        if len(ids) < 2 or assisted:
            return self.model.generate(ids[None], max_new_tokens=max_new_tokens, **kwargs)  # type: ignore[no-any-return]
        # generate() in transformers 5 takes the cache as ``cache``.
        result = self.prefill(ids[:-1], progress=progress)
        if save_reply:
            saves = ReplySaves(self.binding, self.chunk_store, result.cache, ids,
                               fed_last_only=feeds_last_only(result.cache, self.binding.all_recurrent))
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or ()), saves])
        output, fed_last_only = continue_generate(self.model, ids, result.cache, self.binding.all_recurrent,
                                                  max_new_tokens=max_new_tokens, **kwargs)
        if save_reply:
            self.reply_chunks_saved += saves.saved
        if fed_last_only:  # the prompt goes back in front
            return torch.cat([ids[None, :-1], output], dim=1)
        return output  # type: ignore[no-any-return]

    @property
    def _hits_possible(self) -> bool:
        return self.restore_check is None or self.restore_check.passed

    def _hits_checked(self) -> bool:
        """Whether a hit may be served: on a verified transformers version always; on another once the
        restore check passed (run before the first hit, once per process and model)."""
        if not self._check_restores:
            return True
        if self.restore_check is None:
            self.restore_check = checked(self.model, self.binding)
        return self.restore_check.passed

    @property
    def stats(self) -> StoreMetrics:
        """What the store did for this cache: hit and query tokens, loads, saves, bytes, latencies, errors
        (the numbers kvgroups exports to Prometheus; docs/metrics.md says what each means)."""
        return self.chunk_store.stats

    def flush(self) -> None:
        """Wait until every chunk saved so far is in the store."""
        self.chunk_store.flush()

    def close(self) -> None:
        self.chunk_store.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["PrefillResult", "PrefixCache"]
