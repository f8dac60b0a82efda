"""SGLang's pages in a kvgroups store: their keys, their entries, and every store call a miss on failure.

Each page is one kvgroups entry (checksummed, or sealed with a keyed MAC and optionally encrypted under a
deployment secret), stored under a key derived from SGLang's page hash and a namespace of everything that
decides how the page's bytes are read: the model, the pool's layer groups and layout, dtype, page size,
the tensor-parallel rank where ranks hold different shards, the pipeline stage, the tenant salt. Another
model, layout, page size or rank therefore never hits; with a secret the key is keyed too, so nobody
without it can confirm a guessed prompt from the store's keys.

Nothing a store does escapes: a store that is down, slow, full or corrupt is a miss (or a failed write),
counted in kvgroups' metrics, and a store that failed is left alone for a while
(:class:`~kvgroups.store.backends.health.Backoff`), so a hung server costs one timeout, not one per
page. An entry that does not check out is deleted and counted; a page is never served from bytes
another page, model or writer put there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from kvgroups.integrations.sglang.pools import KV_POOL, PagePool, RankInfo
from kvgroups.integrations.sglang.settings import BackendSettings
from kvgroups.store.backends.base import ByteStore, Stored, UnacknowledgedWriteError
from kvgroups.store.backends.health import Backoff, RateLimitedLog
from kvgroups.store.backends.urls import open_store
from kvgroups.store.chunks.copies import first_good_copy
from kvgroups.store.entries.codec import (
    CorruptEntryError,
    EntryInfo,
    entry_data,
    entry_slot_bytes,
    seal_entry,
)
from kvgroups.store.metrics.counters import DROP_BACKED_OFF, REGISTRY, StoreMetrics
from kvgroups.store.metrics.prometheus import install as install_prometheus

logger = logging.getLogger(__name__)

KEY_FORMAT = "kvgroups.sglang-page/1"
# What SGLang's StorageMetrics report, per prefetch and per backup since the last report.
RECENT = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
# Pages handed to the store at once: enough for the Redis tier's connections to write in parallel, few
# enough that a writing thread's reused buffer stays small (SGLang backs up to 128 pages a call).
WRITE_BATCH_PAGES = 8


class PageStore:
    """The pages of the pools SGLang registered, in the store the settings name; thread-safe as the store is."""

    def __init__(self, settings: BackendSettings, rank: RankInfo) -> None:
        self.settings = settings
        self.rank = rank
        self.store: ByteStore = open_store(list(settings.stores))
        self._namespaces: dict[str, bytes] = {}
        self._log = RateLimitedLog(logger)
        self._backoff = Backoff(f"sglang:{self.store.url}", self._log)
        self.stats = StoreMetrics(tier=self.store.tier_name, num_groups=1)
        self.recent: dict[str, list[float]] = {name: [] for name in RECENT}
        self._buffers = threading.local()  # SGLang writes from several threads: write slots each
        REGISTRY.add(self, self.stats)
        install_prometheus()

    def add_pool(self, pool: PagePool) -> None:
        described = {"format": KEY_FORMAT, **pool.describe(), "model": self.rank.model_name,
                     "tp": [self.rank.tp_rank, self.rank.tp_size] if pool.rank_sharded else None,
                     "pp": [self.rank.pp_rank, self.rank.pp_size], "cp": [self.rank.cp_rank, self.rank.cp_size],
                     "salt": self.settings.salt}
        self._namespaces[pool.name] = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()

    # --- keys and entries ------------------------------------------------------------------------
    def store_key(self, page_hash: str, pool_name: str = KV_POOL) -> str:
        """The store key of SGLang's page ``page_hash`` in pool ``pool_name``: keyed under the secret if set."""
        namespace, page = self._namespaces[pool_name], page_hash.encode("utf-8")
        secret = self.settings.secret
        digest = secret.chain(namespace, page) if secret is not None else hashlib.sha256(namespace + page).digest()
        return f"sglang:{digest.hex()}"

    def _info(self, pool: PagePool, key: str) -> EntryInfo:
        return EntryInfo(key=key, fingerprint=pool.fingerprint, group_index=0, chunk_index=0,
                         dtype=pool.page_dtype, shape=(pool.page_numel,))

    def _encode(self, pool: PagePool, key: str, page: torch.Tensor, slot: torch.Tensor) -> memoryview:
        """``page`` (SGLang's page as its host pool holds it: flattened, it is the flat page) as an entry in
        ``slot``: its bytes copied once, from the host pool into place."""
        info = self._info(pool, key)
        if page.numel() != info.shape[0] or page.dtype != info.dtype:
            raise TypeError(f"pool {pool.name!r}: a page of {page.numel()} {page.dtype} values, expected "
                            f"{info.shape[0]} {info.dtype}")
        entry_data(slot, info).view(page.shape).copy_(page)
        return seal_entry(slot, info, secret=self.settings.secret, encrypt=self.settings.encrypt)

    # --- store calls, each a miss on failure -------------------------------------------------------
    def available(self) -> bool:
        return self._backoff.available()

    def _failed(self, action: str, error: BaseException) -> None:
        if action == "save":
            self.stats.failed_saves += 1
        else:
            self.stats.failed_reads += 1
        self.store.record_error(error)
        if not isinstance(error, UnacknowledgedWriteError):  # the store answered: only those pages are not saved
            self._backoff.failed(action, error)

    def existing(self, keys: Sequence[str]) -> list[bool]:
        if not keys or not self.available():
            return [False] * len(keys)
        try:
            return list(self.store.contains_many(list(keys)))
        except Exception as error:  # nothing a store does may reach SGLang's storage threads
            self._failed("lookup", error)
            return [False] * len(keys)

    def read_pages(self, pool: PagePool, page_hashes: Sequence[str],
                   consume: Callable[[int, torch.Tensor], None]) -> list[bool]:
        """Read the pages, all asked of the store at once (one batch: a server's round trip, not one per page),
        into a buffer of the read's own; check each in order and hand it to ``consume`` (which copies it where
        it goes: the page's bytes are read once and copied once), until the first that is missing or does not
        check out; which pages were consumed."""
        done = [False] * len(page_hashes)
        if not page_hashes or not self.available():
            return done
        started = time.perf_counter()
        keys = [self.store_key(page_hash, pool.name) for page_hash in page_hashes]
        max_bytes = self._info(pool, "").max_entry_bytes
        try:
            values = self.store.get_many(keys, max_bytes)
        except Exception as error:  # a failed read is a miss
            self._failed("load", error)
            values = []
        for index, (key, value) in enumerate(zip(keys, values, strict=False)):
            page = self._checked_page(pool, key, value)
            if page is None:
                break
            consume(index, page)
            done[index] = True
        served, seconds = sum(done), time.perf_counter() - started
        self.stats.loaded(served * pool.page_tokens, seconds, short=served < len(done))
        self.stats.bytes_read[0] += served * pool.page_bytes
        self._note("prefetch", served, pool, seconds)
        return done

    def _checked_page(self, pool: PagePool, key: str, value: Stored | None) -> torch.Tensor | None:
        """The page ``value`` holds, checked, as a view of it; None when missing or when no copy checks out. A
        copy that does not is counted and discarded, and where a later tier of a tier list holds another copy,
        that one is read and checked in its place."""
        info = self._info(pool, key)

        def read_again() -> Stored | None:
            try:
                return self.store.get(key, info.max_entry_bytes)
            except Exception as error:  # a failed read is a miss
                self._failed("load", error)
                return None

        found = first_good_copy(value, info, secret=self.settings.secret, tries=len(self.store.tiers),
                                discard=partial(self._discard, key, info.max_entry_bytes), read_again=read_again)
        return None if found is None else found[0]

    def _discard(self, key: str, max_bytes: int, error: CorruptEntryError, value: Stored) -> bool:
        """Count, say (rate-limited) and delete a copy of ``key`` that did not check out; whether a later tier
        holds another."""
        self.stats.corrupt_entries += 1
        self.store.record_error(error)
        self._log.warning("corrupt", "kvgroups HiCache storage: an entry is corrupt (%d so far), discarding it: %s",
                          self.stats.corrupt_entries, error)
        try:
            return self.store.discard_served(key, value, max_bytes)
        except Exception as discard_error:  # the next read misses it all the same
            self.store.record_error(discard_error)
            return False

    def write_pages(self, pool: PagePool, page_hashes: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Write the pages not stored yet (a page SGLang writes twice is written once); whether each is stored."""
        if not page_hashes:
            return []
        if not self.available():
            self.stats.dropped(DROP_BACKED_OFF)
            return [False] * len(page_hashes)
        keys = [self.store_key(page_hash, pool.name) for page_hash in page_hashes]
        started = time.perf_counter()
        written: list[int] = []
        try:
            stored = self.store.contains_many(keys)
            todo = [index for index, there in enumerate(stored) if not there]
            slots = self._write_slots(pool)
            for first in range(0, len(todo), WRITE_BATCH_PAGES):
                batch = todo[first:first + WRITE_BATCH_PAGES]
                items = [(keys[index], self._encode(pool, keys[index], pages[index], slot))
                         for index, slot in zip(batch, slots, strict=False)]
                self.store.put_many(items)
                written += [len(value) for _, value in items]
        except Exception as error:  # a failed write leaves the page to be computed again
            self._failed("save", error)
            return [False] * len(page_hashes)
        seconds = time.perf_counter() - started
        for size in written:
            self.stats.saved(size, seconds / len(written))
        self._note("backup", len(keys), pool, seconds)
        return [True] * len(keys)

    def _write_slots(self, pool: PagePool) -> list[torch.Tensor]:
        """This thread's buffers for ``pool``'s entries while they are written, one per page of a batch: reused,
        since a fresh allocation per page costs more than the page's copy (every write faults its pages in)."""
        slots: dict[str, list[torch.Tensor]] = self._buffers.__dict__.setdefault("writes_by_pool", {})
        size = entry_slot_bytes(self._info(pool, ""))
        if pool.name not in slots or slots[pool.name][0].numel() != size:
            slots[pool.name] = list(torch.empty(WRITE_BATCH_PAGES * size, dtype=torch.uint8).view(-1, size))
        return slots[pool.name]

    def _note(self, direction: str, pages: int, pool: PagePool, seconds: float) -> None:
        if pages:
            self.recent[f"{direction}_pgs"].append(pages)
            self.recent[f"{direction}_bandwidth"].append(pages * pool.page_bytes / max(seconds, 1e-9) / 1e9)

    def gauges(self) -> dict[str, dict[tuple[str, ...], float]]:
        """What is true now, for kvgroups' Prometheus metrics: whether the store is backed off."""
        return {"backed_off": {(self.store.tier_name,): float(not self._backoff.available())}}

    def warn(self, topic: str, message: str, *args: Any) -> None:
        self._log.warning(topic, message, *args)

    def close(self) -> None:
        self.store.close()
