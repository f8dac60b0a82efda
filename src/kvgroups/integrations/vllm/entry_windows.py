"""A load's entries, read a window at a time: as many as the loading thread's free read buffers hold, asked of
the store in one batch (a server's round trip for the window, not one per entry), each checked alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvgroups.integrations.vllm.engine_groups import EngineGroup
from kvgroups.store.chunks.entry_reads import EntryReader


@dataclass(frozen=True)
class NeededEntry:
    """One entry a load reads: chunk ``chunk`` (from token ``first``) of chunk-store group ``member``."""

    engine_group: EngineGroup
    block_ids: np.ndarray
    member: int
    chunk: int
    first: int
    shared: bool  # kept in the deployment-wide shared store (its own reader and keys)


def read_window(window: Sequence[NeededEntry], buffers: Sequence[np.ndarray], keys: Sequence[str],
                shared_keys: Sequence[str], reader: EntryReader,
                shared_reader: EntryReader | None) -> list[torch.Tensor | None]:
    """Each entry of ``window`` read into its buffer (one batch per store), checked; None where one is missing,
    corrupt or unreadable."""
    entries: list[torch.Tensor | None] = [None] * len(window)
    for shared in (False, True):
        picks = [index for index, entry in enumerate(window) if entry.shared == shared]
        source = shared_reader if shared else reader
        if not picks or source is None:
            continue
        names = shared_keys if shared else keys
        read = source.read_many([(names[window[index].chunk], window[index].member, window[index].chunk,
                                  buffers[index]) for index in picks])
        for index, entry in zip(picks, read, strict=True):
            entries[index] = entry
    return entries
