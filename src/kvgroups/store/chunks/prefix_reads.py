"""How a chunk store finds and reads prefixes: ``lookup`` / ``locate`` from which entries exist, ``load`` and
``load_entries`` of the entries at a boundary, read once and checked, and what happens to an entry that
does not check out.

:class:`PrefixReads` is the reading half of :class:`~kvgroups.store.chunks.chunk_store.KVChunkStore`, which
holds the state it reads through (the byte store, the groups, the secret, the counts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.base import ByteStore, Stored
from kvgroups.store.backends.health import Backoff, RateLimitedLog
from kvgroups.store.chunks.copies import first_good_copy
from kvgroups.store.chunks.prefixes import LoadedEntries, LoadedPrefix, StoredPrefix, assemble, stored_prefix
from kvgroups.store.chunks.seen import SeenEntries
from kvgroups.store.entries.codec import CorruptEntryError, EntryInfo
from kvgroups.store.entries.keys import TokenIds, boundary_keys, checked_keys
from kvgroups.store.entries.secret import StoreSecret
from kvgroups.store.metrics.counters import StoreMetrics

if TYPE_CHECKING:
    from collections.abc import Callable

# A stored prefix is retried at most this many times, each at a shorter boundary, when entries fail to load.
_LOAD_ATTEMPTS = 4


class PrefixReads:
    """Lookups and loads over the attributes a :class:`~kvgroups.store.chunks.chunk_store.KVChunkStore` sets."""

    store: ByteStore
    groups: list[KVLayerGroupInfo]
    chunk_size: int
    secret: StoreSecret | None
    stats: StoreMetrics
    seen: SeenEntries
    _backoff: Backoff
    _log: RateLimitedLog
    keys: Callable[..., list[str]]
    entry_info: Callable[[str, int, int], EntryInfo]
    needed_chunks: Callable[[int, int], range]
    _failed: Callable[[str, OSError], None]

    @staticmethod
    def entry_key(prefix_key: str, group_index: int) -> str:
        return f"{prefix_key}.g{group_index}"

    def lookup(self, token_ids: TokenIds | None, *, keys: Sequence[str] | None = None) -> int:
        """The longest stored prefix of ``token_ids`` (a multiple of chunk_size) that every group can serve.

        ``keys`` (from :meth:`keys`) stand for the tokens: pass either.
        """
        return self.locate(token_ids, keys=keys).num_tokens

    def locate(self, token_ids: TokenIds | None, *, keys: Sequence[str] | None = None,
               groups: Sequence[int] | None = None) -> StoredPrefix:
        """What :meth:`lookup` finds, with the tokens each tier holds of it; only ``groups`` (default all) count."""
        begin = time.perf_counter()
        keys = self._keys_of(token_ids, keys)
        found = self._locate(keys, range(len(self.groups)) if groups is None else groups)
        self.stats.looked_up(len(keys) * self.chunk_size, found.tokens_by_tier, time.perf_counter() - begin)
        return found

    def _locate(self, keys: list[str], groups: Sequence[int]) -> StoredPrefix:
        if not keys or not groups or not self._backoff.available():
            return StoredPrefix(0)
        entry_keys = [self.entry_key(key, group) for group in groups for key in keys]
        asked_at = time.monotonic()
        try:
            located = self.store.locate_many(entry_keys)
        except OSError as error:
            self._failed("lookup", error)
            return StoredPrefix(0)
        self._note_vanished(entry_keys, located, asked_at)
        rows = [located[position * len(keys):(position + 1) * len(keys)] for position in range(len(groups))]
        specs = [self.groups[group].spec for group in groups]
        return stored_prefix(specs, rows, self.chunk_size, [tier.tier_name for tier in self.store.tiers])

    def _note_vanished(self, entry_keys: list[str], located: Sequence[int | None], asked_at: float) -> None:
        """Count the entries this process knew were stored that a lookup asked at ``asked_at`` found missing;
        not when some keys went unasked then (a master down, a tier backed off): those may only be out of reach."""
        self.seen.stored(key for key, tier in zip(entry_keys, located, strict=True) if tier is not None)
        if self.store.unanswered_since(asked_at):
            return
        vanished = self.seen.vanished(key for key, tier in zip(entry_keys, located, strict=True) if tier is None)
        if vanished:
            self.stats.vanished_entries += vanished
            self._log.warning("vanished", "chunk store %s: %d entries this process saved or found stored are gone "
                              "(%d so far: a failed-over master that had not passed them to its replica, evicted, "
                              "expired or deleted)", self.store.url, vanished, self.stats.vanished_entries)

    def load(self, token_ids: TokenIds | None, num_tokens: int, *,
             keys: Sequence[str] | None = None) -> LoadedPrefix:
        """Read what every group needs to continue after ``num_tokens`` (a boundary ``lookup`` returned).

        Returns fewer tokens (down to 0) when entries turn out missing or corrupt: those are
        deleted and a shorter stored boundary is tried, so the result is always whole and exact.
        ``keys`` (from :meth:`keys`, at least ``num_tokens / chunk_size`` of them) stand for the
        tokens.
        """
        tensors, keys = self._read_boundary(token_ids, num_tokens, keys)
        return assemble(self.groups, tensors, len(keys), self.chunk_size)  # copied out of the values read

    def load_entries(self, token_ids: TokenIds | None, num_tokens: int, *,
                     keys: Sequence[str] | None = None) -> LoadedEntries:
        """:meth:`load` without putting the prefix together: every entry it needs, checked as ``load`` checks
        them, as views of the values read (no copy), for a caller that copies each into its cache."""
        tensors, keys = self._read_boundary(token_ids, num_tokens, keys)
        return LoadedEntries(num_tokens=len(keys) * self.chunk_size, entries=tensors)

    def verify(self, token_ids: TokenIds | None, num_tokens: int, *, keys: Sequence[str] | None = None) -> int:
        """The longest boundary up to ``num_tokens`` whose entries all read back whole: :meth:`load`, unassembled.

        For a caller that must promise a hit before it loads (a scheduler): entries that are
        missing or corrupt now cost a miss now, not a failed load later.
        """
        _, keys = self._read_boundary(token_ids, num_tokens, keys)
        return len(keys) * self.chunk_size

    def _keys_of(self, token_ids: TokenIds | None, keys: Sequence[str] | None) -> list[str]:
        if keys is not None:
            return checked_keys(keys)
        if token_ids is None:
            raise KVGroupsError("pass token_ids or keys")
        return self.keys(token_ids)

    def _read_boundary(self, token_ids: TokenIds | None, num_tokens: int,
                       keys: Sequence[str] | None) -> tuple[dict[tuple[int, int], torch.Tensor], list[str]]:
        """The entries at the longest readable boundary up to ``num_tokens`` (views of the values read), and
        the keys up to it: a boundary whose entries turn out missing or corrupt gives way to the longest
        shorter one stored."""
        keys = boundary_keys(token_ids, keys, num_tokens, self.chunk_size, self.keys)
        asked = len(keys)
        begin = time.perf_counter()
        tensors: dict[tuple[int, int], torch.Tensor] | None = {}
        for _ in range(_LOAD_ATTEMPTS):
            tensors = self._read(keys) if keys and self._backoff.available() else None
            if tensors is not None or not keys or not self._backoff.available():
                break
            shorter = self._locate(keys[:-1], range(len(self.groups))).num_tokens if len(keys) > 1 else 0
            keys = keys[: shorter // self.chunk_size]
        if tensors is None:  # an unavailable store serves no boundary, nor does one that never read back whole
            tensors, keys = {}, []
        self.stats.loaded(len(keys) * self.chunk_size, time.perf_counter() - begin, short=len(keys) < asked)
        return tensors, keys

    def _read(self, keys: list[str]) -> dict[tuple[int, int], torch.Tensor] | None:
        """Every group's needed entries at boundary ``len(keys)``, by (group, chunk), as views of the values
        read; None when one is bad, or the read fails."""
        num_chunks = len(keys)
        wanted = [
            self.entry_info(keys[chunk], group, chunk)
            for group in range(len(self.groups)) for chunk in self.needed_chunks(group, num_chunks)
        ]
        try:
            values = self.store.get_many([info.key for info in wanted],
                                         max((info.max_entry_bytes for info in wanted), default=0))
        except OSError as error:
            self._failed("load", error)
            return None
        self.store.record_read(len(values), sum(value is not None for value in values))
        tensors: dict[tuple[int, int], torch.Tensor] = {}
        whole = True
        for info, value in zip(wanted, values, strict=True):
            tensor = self.checked_entry(info, value, partial(self._read_again, info))
            if tensor is None:
                whole = False
                continue
            tensors[info.group_index, info.chunk_index] = tensor
        return tensors if whole else None

    def checked_entry(self, info: EntryInfo, value: Stored | None,
                      read_again: Callable[[], Stored | None]) -> torch.Tensor | None:
        """The entry ``value`` holds, as a view of it; None when it is missing or no copy checks out. A copy
        that does not is discarded and, where a later tier holds another, ``read_again`` reads that one
        (None when it fails, the caller's failure counted), which is checked in turn."""
        found = first_good_copy(value, info, secret=self.secret, tries=len(self.store.tiers),
                                discard=partial(self.discard_corrupt, info), read_again=read_again)
        if found is None:
            return None
        tensor, value = found
        self.stats.bytes_read[info.group_index] += len(value)
        return tensor

    def _read_again(self, info: EntryInfo) -> Stored | None:
        try:
            return self.store.get(info.key, info.max_entry_bytes)
        except OSError as error:
            self._failed("load", error)
            return None

    def discard_corrupt(self, info: EntryInfo, error: CorruptEntryError, value: Stored) -> bool:
        """An entry read as ``info`` did not check out (as ``value``): count it, say so (rate-limited) and
        delete that copy; whether a later tier holds another copy, to read instead."""
        self.stats.corrupt_entries += 1
        self.seen.forget([info.key])  # deleted here on purpose: not a vanished entry when missing later
        self.store.record_error(error)
        self._log.warning("corrupt", "chunk store %s: an entry is corrupt (%d so far), deleting it: %s",
                          self.store.url, self.stats.corrupt_entries, error)
        try:
            return self.store.discard_served(info.key, value, info.max_entry_bytes)
        except OSError:  # a failed delete leaves it unusable all the same: reads check it
            return False

