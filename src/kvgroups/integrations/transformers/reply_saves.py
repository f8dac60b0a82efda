"""The chunks a reply fills, saved while ``PrefixCache.generate`` generates it.

``generate`` asks its stopping criteria after every step, once the step's tokens are in
``input_ids`` and the cache holds every token but the newest: :class:`ReplySaves` is one such
criterion, which never stops anything. A chunk whose end the cache has just reached is saved whole,
its recurrent states being those after exactly its last token and a sliding window's its last
tokens, as a prefill saves its chunks. Each step feeds one token, so every chunk end is reached
exactly (``PrefixCache.generate`` runs assisted decoding, which would step past some, without a
cache of its own); a chunk whose end a step passed anyway is not saved: nothing in the cache is at
its end any more.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from transformers import StoppingCriteria

from kvgroups.integrations.transformers.cache_binding import CacheBinding
from kvgroups.store import KVChunkStore
from kvgroups.store.entries.keys import token_array

logger = logging.getLogger(__name__)


class ReplySaves(StoppingCriteria):  # type: ignore[misc]
    """Saves the reply's full chunks as ``generate`` computes them; ``saved``: how many so far."""

    def __init__(self, binding: CacheBinding, store: KVChunkStore, cache: Any, prompt: torch.Tensor, *,
                 fed_last_only: bool) -> None:
        self.binding, self.store, self.cache = binding, store, cache
        self.chunk_size = store.chunk_size
        # Where generate's sequences start: the prompt, or only its last token (its other tokens in front).
        self._before = token_array(prompt[:-1]) if fed_last_only else token_array(prompt[:0])
        self._next_chunk = (len(prompt) - 1) // self.chunk_size  # the prefill saved every chunk before it
        self.saved = 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[0] != 1:  # beams or a batch: not one sequence's cache
            return never
        try:
            self._save(input_ids[0])
        except Exception:  # a save that fails costs a later miss, never the reply
            logger.exception("saving a reply's chunk failed")
        return never

    def _save(self, sequence: torch.Tensor) -> None:
        computed = len(self._before) + sequence.shape[0] - 1  # the newest token is not in the cache yet
        last = computed // self.chunk_size
        if last <= self._next_chunk:
            return
        self._next_chunk = last
        if computed % self.chunk_size:
            logger.debug("a step passed the end of chunk %d without stopping there: not saved", last - 1)
            return
        keys = self.store.keys(np.concatenate([self._before, token_array(sequence)])[:computed])
        packed = self.binding.bind(self.cache, computed).pack(computed - self.chunk_size, computed)
        if self.store.save_chunk(keys[last - 1], last - 1, dict(enumerate(packed))):
            self.saved += 1
