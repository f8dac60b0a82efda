"""Stored chunks to test against: a chunk store's metadata from a list of layer kinds, per-group tensors
whose values say which prefix and chunk they belong to, and prompts saved whole."""

from __future__ import annotations

from typing import Any

import torch

from kvgroups import ChunkedLocal, FullAttention, LayerCacheSpec, LMCacheMetadata, RecurrentState, SlidingWindow
from kvgroups.store import KVChunkStore
from tests.support.helpers import meta

# A full, a sliding (12-token window) and a recurrent layer: each kind of what a group keeps at a boundary.
MIXED_KINDS = [("full", 0), ("sliding", 12), ("recurrent", 0)]
TOKENS = list(range(40))  # 5 chunks of 8


def build_metadata(kinds: list[tuple[str, int]], *, model_name: str = "m", num_kv_heads: int = 2,
                   chunk_size: int = 8) -> LMCacheMetadata:
    """One layer per entry: (kind, window or attention-chunk tokens)."""
    caches: dict[str, Any] = {}
    specs: dict[str, LayerCacheSpec] = {}
    for index, (kind, tokens) in enumerate(kinds):
        name = f"layers.{index}"
        if kind == "mla":
            caches[name] = meta(8, 16, 12)
        elif kind == "recurrent":
            caches[name] = (meta(4, 3, 2), meta(4, 2, 2, 2))
            specs[name] = RecurrentState(state_shapes=((3, 2), (2, 2, 2)))
        else:
            caches[name] = meta(2, 8, 16, num_kv_heads, 4)
            if kind == "sliding":
                specs[name] = SlidingWindow(window_tokens=tokens)
            elif kind == "chunked":
                specs[name] = ChunkedLocal(chunk_tokens=tokens)
            else:
                specs[name] = FullAttention()
    use_mla = any(kind == "mla" for kind, _ in kinds)
    metadata = LMCacheMetadata(model_name, 1, 1, 0, 0, torch.bfloat16, (len(kinds), 1 if use_mla else 2, 256,
                                                                        1 if use_mla else num_kv_heads, 4),
                               use_mla=use_mla, chunk_size=chunk_size)
    metadata.kv_layer_groups_manager.build_kv_layer_groups(caches, specs)
    return metadata


def chunk_tensors(store: KVChunkStore, tokens: list[int], chunk_index: int) -> list[torch.Tensor]:
    """Per-group tensors whose values say which prefix and chunk they belong to."""
    generator = torch.Generator().manual_seed(hash((tuple(tokens[: (chunk_index + 1) * store.chunk_size]),)) % 2**31)
    return [torch.randn(group.chunk_shape(store.chunk_size), generator=generator).to(group.dtype)
            for group in store.groups]


def saved_store(metadata: LMCacheMetadata, store: Any, tokens: list[int], *, salt: str = "") -> KVChunkStore:
    chunk_store = KVChunkStore(metadata, store, salt=salt)
    keys = chunk_store.keys(tokens)
    for chunk in range(len(keys)):
        chunk_store.save(tokens, chunk, chunk_tensors(chunk_store, tokens, chunk), keys=keys)
    chunk_store.flush()
    return chunk_store


def prompts(count: int) -> list[list[int]]:
    return [[1000 * prompt + token for token in range(40)] for prompt in range(count)]


def save_all(store: KVChunkStore, tokens_list: list[list[int]]) -> None:
    for tokens in tokens_list:
        keys = store.keys(tokens)
        for chunk in range(len(keys)):
            store.save(tokens, chunk, chunk_tensors(store, tokens, chunk), keys=keys)
    assert store.flush(timeout=30)
