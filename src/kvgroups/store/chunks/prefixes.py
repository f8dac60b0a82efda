"""What each group needs from the store at a boundary, and a loaded prefix put together from entries.

Each group is asked only for what it keeps (its spec's ``tokens_needed``): a full-attention or
MLA group needs every chunk before a boundary, a sliding-window group only the chunks overlapping
its window, a chunked-local group only the current attention chunk, a recurrent group only its
state at the boundary (saved with the chunk that ends there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.sizes import ceil_div


@dataclass(frozen=True)
class GroupPrefix:
    """One group's part of a loaded prefix.

    Token groups: ``tensor`` is ``[kv_size, num_layers, tokens, hidden_dim_size]`` holding tokens
    ``first_token ..`` up to the boundary (all of them for full attention, the window for sliding
    layers). Recurrent groups: ``[1, num_layers, 1, state_elements]``, the state at the boundary.
    """

    group_index: int
    first_token: int
    tensor: torch.Tensor

    def rows(self, positions: np.ndarray) -> torch.Tensor:
        """The stored rows of the tokens at ``positions`` (each at least ``first_token``), as a new
        contiguous ``[kv_size, num_layers, len(positions), hidden_dim_size]`` tensor."""
        columns = torch.from_numpy(np.asarray(positions, dtype=np.int64) - self.first_token)
        return self.tensor.index_select(2, columns.to(self.tensor.device))


@dataclass(frozen=True)
class LoadedEntries:
    """What ``load_entries`` found: the first ``num_tokens`` tokens' entries (none for 0), each as
    :class:`LoadedPrefix` would hold its chunk, by (group index, chunk index); they may be views of
    the values read, which they keep alive, and are only read."""

    num_tokens: int
    entries: Mapping[tuple[int, int], torch.Tensor]

    def chunks(self, group_index: int) -> list[tuple[int, torch.Tensor]]:
        """Group ``group_index``'s entries, (chunk index, tensor), in order."""
        return sorted(((chunk, tensor) for (group, chunk), tensor in self.entries.items() if group == group_index),
                      key=lambda item: item[0])


@dataclass(frozen=True)
class LoadedPrefix:
    """What ``load`` found: the first ``num_tokens`` tokens' caches, one part per group (none for 0)."""

    num_tokens: int
    groups: tuple[GroupPrefix, ...] = ()


def needed_chunks(spec: LayerCacheSpec, num_chunks: int, chunk_size: int) -> range:
    """The chunks a group of ``spec`` needs to continue after ``num_chunks`` full chunks of ``chunk_size``."""
    if not spec.token_indexed:
        return range(num_chunks - 1, num_chunks)  # the state saved with the chunk ending there
    start, end = spec.tokens_needed(num_chunks * chunk_size)
    return range(start // chunk_size, ceil_div(end, chunk_size)) if start < end else range(0)


def servable_chunks(specs: Sequence[LayerCacheSpec], present: Sequence[Sequence[bool]], chunk_size: int) -> int:
    """The most full chunks after which every group has all it needs, given which of its entries exist.

    ``present[g][i]`` says whether group ``g``'s entry of chunk ``i`` is stored (every group is
    asked about the same chunks). A recurrent group needs its state where the prefix ends, a
    sliding one the chunks of its window, so the answer is not simply the first gap.
    """
    num_chunks = min((len(row) for row in present), default=0)
    # stored_before[g][i]: entries of group g present among chunks [0, i).
    stored_before = []
    for row in present:
        counts = [0]
        for found in row[:num_chunks]:
            counts.append(counts[-1] + found)
        stored_before.append(counts)
    for candidate in range(num_chunks, 0, -1):
        if all(stored_before[group][needed.stop] - stored_before[group][needed.start] == len(needed)
               for group, needed in ((group, needed_chunks(spec, candidate, chunk_size))
                                     for group, spec in enumerate(specs))):
            return candidate
    return 0


def assemble(groups: Sequence[KVLayerGroupInfo], tensors: Mapping[tuple[int, int], torch.Tensor], num_chunks: int,
             chunk_size: int) -> LoadedPrefix:
    """The prefix of ``num_chunks`` chunks from entries ``(group, chunk) -> tensor`` (every needed one present),
    in tensors of its own (the entries may be views of values read)."""
    if not num_chunks:
        return LoadedPrefix(num_tokens=0)
    parts = []
    for index, group in enumerate(groups):
        needed = needed_chunks(group.spec, num_chunks, chunk_size)
        if not group.token_indexed:
            parts.append(GroupPrefix(index, num_chunks * chunk_size, tensors[index, needed.start].clone()))
            continue
        chunks = [tensors[index, chunk] for chunk in needed]
        tensor = torch.cat(chunks, dim=2) if chunks else torch.empty(group.chunk_shape(0), dtype=group.dtype)
        first = needed.start * chunk_size if chunks else num_chunks * chunk_size
        parts.append(GroupPrefix(index, first, tensor))
    return LoadedPrefix(num_tokens=num_chunks * chunk_size, groups=tuple(parts))


@dataclass(frozen=True)
class StoredPrefix:
    """A lookup's answer: the tokens stored for every group, and the tier serving each of its chunks."""

    num_tokens: int
    chunk_tiers: tuple[str, ...] = ()  # per chunk of the prefix, the tier its entries are read from

    @property
    def tokens_by_tier(self) -> dict[str, int]:
        """How many of the prefix's tokens each tier serves."""
        if not self.chunk_tiers:
            return {}
        chunk_size = self.num_tokens // len(self.chunk_tiers)
        by_tier: dict[str, int] = {}
        for tier in self.chunk_tiers:
            by_tier[tier] = by_tier.get(tier, 0) + chunk_size
        return by_tier


def stored_prefix(specs: Sequence[LayerCacheSpec], located: Sequence[Sequence[int | None]], chunk_size: int,
                  tier_names: Sequence[str]) -> StoredPrefix:
    """The servable prefix from ``located[group][chunk]`` (the index of the first tier holding that
    entry, None when none does), and the tier serving each of its chunks: the slowest tier holding
    one of the entries a load of the prefix reads for that chunk (the fastest where it reads none)."""
    num_chunks = servable_chunks(specs, [[where is not None for where in row] for row in located], chunk_size)
    if not num_chunks:
        return StoredPrefix(0)
    depths = [0] * num_chunks
    for spec, row in zip(specs, located, strict=True):
        for chunk in needed_chunks(spec, num_chunks, chunk_size):
            depths[chunk] = max(depths[chunk], row[chunk] or 0)
    return StoredPrefix(num_chunks * chunk_size, tuple(tier_names[depth] for depth in depths))
