"""``KVGroupsHiCacheStorage``: SGLang's HiCache L3 storage on kvgroups' byte stores and entries.

SGLang names each page of ``page_size`` tokens by a hash chained over the pages before it, and asks in
batches from its storage threads: which leading pages exist (prefetch), read them into host pages,
write host pages (backup). Each page is one kvgroups entry (checksummed, or sealed with a keyed MAC and
optionally encrypted under a deployment secret) stored under a key derived from SGLang's page hash and
a namespace of everything that decides how the page's bytes are read: the model, the pool's layer groups
and layout, dtype, page size, the tensor-parallel rank where ranks hold different shards, the pipeline
stage, the tenant salt. Another model, layout, page size or rank therefore never hits; with a secret
the key is keyed too, so nobody without it can confirm a guessed prompt from the store's keys.

Nothing the store does reaches SGLang's threads as an exception: a store that is down, slow, full or
corrupt is a miss (or a failed write), counted in kvgroups' metrics, and a store that failed is left
alone for a while (:class:`~kvgroups.store.backends.health.Backoff`) so a hung server costs one timeout,
not one per page. An entry that does not check out is deleted and counted; a page is never served
from bytes another page, model or writer put there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvgroups.integrations.sglang.pools import KV_POOL, PagePool, RankInfo, describe_pool
from kvgroups.integrations.sglang.settings import BackendSettings
from kvgroups.store.backends.base import ByteStore
from kvgroups.store.backends.health import Backoff, RateLimitedLog
from kvgroups.store.backends.urls import open_store
from kvgroups.store.entries.codec import CorruptEntryError, EntryInfo, decode_entry, encode_entry
from kvgroups.store.metrics.counters import DROP_BACKED_OFF, REGISTRY, StoreMetrics
from kvgroups.store.metrics.prometheus import install as install_prometheus

logger = logging.getLogger(__name__)

KEY_FORMAT = "kvgroups.sglang-page/1"


class KVGroupsHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a kvgroups store: both data paths (``batch_get`` / ``batch_set`` on
    flat pages, and with ``"interface_v1": 1`` ``batch_get_v1`` / ``batch_set_v1`` on the host pool)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.rank = RankInfo.of(storage_config)
        # Under MLA one rank writes for all (SGLang's is_storage_writer); every rank reads.
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.store: ByteStore = open_store(list(self.settings.stores))
        self.pools: dict[str, PagePool] = {}
        self._namespaces: dict[str, bytes] = {}
        self._log = RateLimitedLog(logger)
        self._backoff = Backoff(f"sglang:{self.store.url}", self._log)
        self.stats = StoreMetrics(tier=self.store.tier_name, num_groups=1)
        self._recent: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                "backup_bandwidth": []}
        REGISTRY.add(self, self.stats)
        install_prometheus()
        logger.info("kvgroups HiCache storage on %s (tp rank %d of %d)", ", ".join(self.settings.shown_stores),
                    self.rank.tp_rank, self.rank.tp_size)

    # --- pools -------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name not in self.pools or self.pools[name].host_pool is not host_pool:
            self._add_pool(name, host_pool)

    def _add_pool(self, name: str, host_pool: Any) -> None:
        pool = describe_pool(name, host_pool, self.rank)
        described = {"format": KEY_FORMAT, **pool.describe(), "model": self.rank.model_name,
                     "tp": [self.rank.tp_rank, self.rank.tp_size] if pool.rank_sharded else None,
                     "pp": [self.rank.pp_rank, self.rank.pp_size], "cp": [self.rank.cp_rank, self.rank.cp_size],
                     "salt": self.settings.salt}
        self._namespaces[name] = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).digest()
        self.pools[name] = pool

    def _pool(self) -> PagePool:
        pool = self.pools.get(KV_POOL)
        if pool is None:
            raise RuntimeError("kvgroups HiCache storage: no host pool was registered")
        return pool

    # --- keys and entries ------------------------------------------------------------------------
    def store_key(self, page_hash: str, pool_name: str = KV_POOL) -> str:
        """The store key of SGLang's page ``page_hash`` in pool ``pool_name``: keyed under the secret if set."""
        namespace, page = self._namespaces[pool_name], page_hash.encode("utf-8")
        secret = self.settings.secret
        digest = secret.chain(namespace, page) if secret is not None else hashlib.sha256(namespace + page).digest()
        return f"sglang:{digest.hex()}"

    def _info(self, pool: PagePool, key: str) -> EntryInfo:
        return EntryInfo(key=key, fingerprint=pool.metadata.fingerprint(), group_index=0, chunk_index=0,
                         dtype=pool.page_dtype, shape=(pool.page_numel,))

    def _encode(self, pool: PagePool, key: str, page: torch.Tensor) -> bytes:
        return encode_entry(page.reshape(-1), self._info(pool, key), secret=self.settings.secret,
                            encrypt=self.settings.encrypt)

    # --- store calls, each a miss on failure -------------------------------------------------------
    def _available(self) -> bool:
        return self._backoff.available()

    def _failed(self, action: str, error: BaseException) -> None:
        if action == "save":
            self.stats.failed_saves += 1
        else:
            self.stats.failed_reads += 1
        self.store.record_error(error)
        self._backoff.failed(action, error)

    def _existing(self, keys: Sequence[str]) -> list[bool]:
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            return list(self.store.contains_many(list(keys)))
        except Exception as error:  # nothing a store does may reach SGLang's storage threads
            self._failed("lookup", error)
            return [False] * len(keys)

    def _read_pages(self, pool: PagePool, page_hashes: Sequence[str]) -> list[torch.Tensor | None]:
        """The pages, decoded and checked, until the first that is missing or does not check out."""
        if not page_hashes or not self._available():
            return [None] * len(page_hashes)
        keys = [self.store_key(page_hash, pool.name) for page_hash in page_hashes]
        infos = [self._info(pool, key) for key in keys]
        started = time.perf_counter()
        try:
            values = self.store.get_many(keys, max_bytes=infos[0].max_entry_bytes)
        except Exception as error:  # a failed read is a miss
            self._failed("load", error)
            return [None] * len(page_hashes)
        pages: list[torch.Tensor | None] = []
        for key, info, value in zip(keys, infos, values, strict=True):
            page = None if value is None or (pages and pages[-1] is None) else self._decode(key, info, value)
            pages.append(page)
        served = sum(page is not None for page in pages)
        self.stats.loaded(served * pool.page_tokens, time.perf_counter() - started, short=served < len(pages))
        self.stats.bytes_read[0] += served * pool.page_bytes
        self._note("prefetch", served, pool, time.perf_counter() - started)
        return pages

    def _decode(self, key: str, info: EntryInfo, value: Any) -> torch.Tensor | None:
        try:
            return decode_entry(value, info, secret=self.settings.secret)
        except CorruptEntryError as error:
            self.stats.corrupt_entries += 1
            self.store.record_error(error)
            self._log.warning("corrupt", "kvgroups HiCache storage: an entry is corrupt (%d so far), deleting it: "
                              "%s", self.stats.corrupt_entries, error)
            try:
                self.store.delete(key)
            except Exception as delete_error:  # the next read misses it all the same
                self.store.record_error(delete_error)
            return None

    def _write_pages(self, pool: PagePool, page_hashes: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Write the pages not stored yet (a page SGLang writes twice is written once); whether each is stored."""
        if not page_hashes:
            return []
        if not self._available():
            self.stats.dropped(DROP_BACKED_OFF)
            return [False] * len(page_hashes)
        keys = [self.store_key(page_hash, pool.name) for page_hash in page_hashes]
        started = time.perf_counter()
        try:
            stored = self.store.contains_many(keys)
            items = [(key, self._encode(pool, key, page))
                     for key, page, there in zip(keys, pages, stored, strict=True) if not there]
            if items:
                self.store.put_many(items)
        except Exception as error:  # a failed write leaves the page to be computed again
            self._failed("save", error)
            return [False] * len(page_hashes)
        seconds = time.perf_counter() - started
        for _, value in items:
            self.stats.saved(len(value), seconds / len(items))
        self._note("backup", len(keys), pool, seconds)
        return [True] * len(keys)

    def _note(self, direction: str, pages: int, pool: PagePool, seconds: float) -> None:
        if pages:
            self._recent[f"{direction}_pgs"].append(pages)
            self._recent[f"{direction}_bandwidth"].append(pages * pool.page_bytes / max(seconds, 1e-9) / 1e9)

    # --- SGLang's generic data path: flat pages ----------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        started = time.perf_counter()
        pool = self._pool()
        found = self._existing([self.store_key(key) for key in keys])
        hits = found.index(False) if False in found else len(found)
        self.stats.looked_up(len(keys) * pool.page_tokens, {self.store.tier_name: hits * pool.page_tokens},
                             time.perf_counter() - started)
        return hits

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        (page,) = self.batch_get([key], [target_location], target_sizes)
        return page

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        pool = self._pool()
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        results: list[torch.Tensor | None] = []
        for page, target in zip(self._read_pages(pool, keys), targets, strict=True):
            if page is None or target is None:
                results.append(page)
                continue
            target.view(-1).copy_(page)
            results.append(target)
        return results

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not self.is_writer:
            return True
        pool = self._pool()
        return all(self._write_pages(pool, keys, list(values)))

    # --- zero-copy data path ("interface_v1"): pages straight from and into the host pool -----------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self._pool()
        results = []
        for index, page in enumerate(self._read_pages(pool, keys)):
            if page is not None:
                pool.write(int(host_indices[index * pool.page_tokens]), page)
            results.append(page is not None)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not self.is_writer:
            return [True] * len(keys)
        pool = self._pool()
        pages = [pool.read(int(host_indices[index * pool.page_tokens])) for index in range(len(keys))]
        return self._write_pages(pool, keys, pages)

    # --- what SGLang reports ----------------------------------------------------------------------
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s of each prefetch and backup)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: PLC0415 - SGLang's own

        metrics = StorageMetrics()
        for name, values in self._recent.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def gauges(self) -> dict[str, dict[tuple[str, ...], float]]:
        """What is true now, for kvgroups' Prometheus metrics: whether the store is backed off."""
        return {"backed_off": {(self.store.tier_name,): float(not self._backoff.available())}}

    def close(self) -> None:
        self.store.close()
