"""Stored entries read into reused buffers (one at a time, or a batch at once) and checked without a copy, for
callers that stream a prefix.

:meth:`KVChunkStore.load <kvgroups.store.chunks.chunk_store.KVChunkStore.load>` returns a whole prefix in
tensors of their own; a caller that promised a boundary from :meth:`~KVChunkStore.lookup` and
moves each entry on as it arrives (a vLLM worker copying into its blocks) reads entries here
instead: each is read straight into the caller's buffer (where the tier can), checked exactly as
``load`` checks it, and handed over as a view of the buffer, so its bytes are read once and copied
once, into their destination. A missing, corrupt (then deleted) or unreadable entry is None and
counted in the chunk store's stats; a store that fails is left alone for a while, as ``load`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from kvgroups.store.backends.base import Stored
from kvgroups.store.backends.health import Backoff, RateLimitedLog
from kvgroups.store.chunks.chunk_store import KVChunkStore

logger = logging.getLogger(__name__)


class EntryReader:
    """Reads ``store``'s entries one at a time into buffers from :meth:`buffer`."""

    def __init__(self, store: KVChunkStore) -> None:
        self.store = store
        self._log = RateLimitedLog(logger)
        self._backoff = Backoff(store.store.url, self._log)

    def buffer_size(self) -> int:
        """Bytes that hold any one entry of the store's groups (and one byte more, to see a longer value)."""
        groups = range(len(self.store.groups))
        return max(self.store.entry_info("", group, 0).max_entry_bytes for group in groups) + 1

    def buffer(self) -> bytearray:
        """A buffer of :meth:`buffer_size` bytes."""
        return bytearray(self.buffer_size())

    def read(self, key: str, group_index: int, chunk_index: int, buffer: Any) -> torch.Tensor | None:
        """The entry's tensor, a view of ``buffer`` (any writable contiguous bytes: a bytearray, a uint8
        array; an encrypted entry's plaintext is new memory): use it before reading the next entry into
        the same buffer. None when it is missing, corrupt (then deleted) or the store fails."""
        return self.read_many([(key, group_index, chunk_index, buffer)])[0]

    def read_many(self, wanted: Sequence[tuple[str, int, int, Any]]) -> list[torch.Tensor | None]:
        """:meth:`read` of each ``(key, group_index, chunk_index, buffer)``, the values asked of the store at
        once (one batch: a server's round trip for all of them, not one per entry), each checked alone; the
        buffers must be distinct."""
        if not wanted or not self._backoff.available():
            return [None] * len(wanted)
        infos = [self.store.entry_info(key, group, chunk) for key, group, chunk, _ in wanted]
        byte_store = self.store.store
        try:
            values = byte_store.get_many_into([info.key for info in infos],
                                              [memoryview(buffer) for *_, buffer in wanted])
        except OSError as error:
            self._failed(error)
            return [None] * len(wanted)
        byte_store.record_read(len(values), sum(value is not None for value in values))
        # A copy that does not check out is discarded; a later tier's, where one holds it, is read next.
        return [self.store.checked_entry(info, value, partial(self._get_into, info.key, buffer))
                for info, value, (*_, buffer) in zip(infos, values, wanted, strict=True)]

    def _get_into(self, key: str, buffer: Any) -> Stored | None:
        byte_store = self.store.store
        try:
            value = byte_store.get_into(key, memoryview(buffer))
        except OSError as error:
            self._failed(error)
            return None
        byte_store.record_read(1, value is not None)
        return value

    def _failed(self, error: OSError) -> None:
        """A read the store failed: counted, and the store left alone for a while."""
        self.store.stats.failed_reads += 1
        self.store.store.record_error(error)
        self._backoff.failed("load", error)
