"""``KVGroupsHiCacheStorage``: SGLang's HiCache L3 storage on kvgroups' byte stores and entries.

SGLang names each page of ``page_size`` tokens by a hash chained over the pages before it, and asks in
batches from its storage threads: which leading pages exist (prefetch), read them into host pages,
write host pages (backup), and for a hybrid the same of the pools beside the KV pool (recurrent states),
each with its hit policy (:mod:`~kvgroups.integrations.sglang.prefix_hits`). This module is SGLang's API;
the pages' keys, entries and failures are :mod:`~kvgroups.integrations.sglang.page_store`'s, the pools'
description :mod:`~kvgroups.integrations.sglang.pools`'. A read stops at the first page that is missing or
does not check out, and nothing a store does reaches SGLang's threads as an exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from kvgroups.integrations.sglang.page_store import PageStore
from kvgroups.integrations.sglang.pools import (
    KV_POOL,
    PagePool,
    RankInfo,
    UnsupportedPoolError,
    deepseek_v4_pools,
    describe_pool,
    is_deepseek_v4_anchor,
)
from kvgroups.integrations.sglang.prefix_hits import POLICIES, PoolPresence, leading, prefix_hits
from kvgroups.integrations.sglang.settings import BackendSettings

logger = logging.getLogger(__name__)


def _plain(name: Any) -> str:
    """SGLang's pool names and hit policies, enums or their string values, as the strings."""
    return str(getattr(name, "value", name))


class KVGroupsHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` on a kvgroups store: both data paths (``batch_get`` / ``batch_set`` on
    flat pages, and with ``"interface_v1": 1`` ``batch_get_v1`` / ``batch_set_v1`` on the host pool)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.rank = RankInfo.of(storage_config)
        # Under MLA one rank writes for all (SGLang's is_storage_writer); every rank reads.
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.pages = PageStore(self.settings, self.rank)
        self.store = self.pages.store
        self.stats = self.pages.stats
        self.pools: dict[str, PagePool] = {}
        logger.info("kvgroups HiCache storage on %s (tp rank %d of %d)", ", ".join(self.settings.shown_stores),
                    self.rank.tp_rank, self.rank.tp_size)

    # --- pools -------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _plain(host_pool_name)
        if name not in self.pools or self.pools[name].host_pool is not host_pool:
            self._add_pool(name, host_pool)

    def _add_pool(self, name: str, host_pool: Any) -> None:
        pool = describe_pool(name, host_pool, self.rank)
        self.pages.add_pool(pool)
        self.pools[name] = pool

    def on_host_pools_registered(self) -> None:
        """SGLang registered every pool: DeepSeek-V4's byte pools and its logical anchor come together or not at
        all (an anchor alone would store markers of pages nobody holds; a byte pool without the anchor would be
        asked under another pool's indices)."""
        super().on_host_pools_registered()
        kv = self.pools.get(KV_POOL)
        byte_pools = sorted(name for name in self.pools if name in deepseek_v4_pools())
        if kv is not None and is_deepseek_v4_anchor(kv) and not byte_pools:
            raise UnsupportedPoolError("SGLang registered a logical anchor pool and none of DeepSeek-V4's pools beside "
                                       f"it ({', '.join(deepseek_v4_pools())}): nothing to store")
        if byte_pools and (kv is None or not is_deepseek_v4_anchor(kv)):
            raise UnsupportedPoolError(f"SGLang registered DeepSeek-V4's pools {', '.join(byte_pools)} without their "
                                       "logical anchor as the 'kv' pool")

    def _pool(self) -> PagePool:
        pool = self.pools.get(KV_POOL)
        if pool is None:
            raise RuntimeError("kvgroups HiCache storage: no host pool was registered")
        return pool

    # --- SGLang's generic data path: flat pages ----------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        started = time.perf_counter()
        pool = self._pool()
        found = self.pages.existing([self.pages.store_key(key) for key in keys])
        hits = leading(found)
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
        results: list[torch.Tensor | None] = [None] * len(keys)

        def into_target(index: int, page: torch.Tensor) -> None:
            target = targets[index]
            if target is None:
                results[index] = page.clone()
            else:
                target.view(-1).copy_(page)
                results[index] = target

        self.pages.read_pages(pool, keys, into_target)
        return results

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        pool = self._pool()
        if not self._writes(pool):
            return True
        return all(self.pages.write_pages(pool, keys, list(values)))

    def _writes(self, pool: PagePool) -> bool:
        """Whether this rank stores ``pool``'s pages: every rank its own shard; a pool every rank holds alike
        (MLA's KV) only the rank SGLang names its writer."""
        return pool.rank_sharded or self.is_writer

    # --- zero-copy data path ("interface_v1"): pages straight from and into the host pool -----------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self._pool()
        return self.pages.read_pages(
            pool, keys, lambda index, page: pool.write(int(host_indices[index * pool.page_tokens]), page))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self._pool()
        if not self._writes(pool):
            return [True] * len(keys)
        pages = [pool.read(int(host_indices[index * pool.page_tokens])) for index in range(len(keys))]
        return self.pages.write_pages(pool, keys, pages)

    # --- hybrids: pools beside the KV pool (recurrent states), each with its hit policy ----------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The longest prefix of ``keys`` whose KV pages exist and at whose end every other pool has what its
        hit policy asks for: every page (``ALL_PAGES``), or the last ``len(transfer.keys)`` pages
        (``TRAILING_PAGES``: a recurrent state exists only where a node ended); every such prefix length is
        reported, since each rank's shard may hold another set and SGLang intersects them."""
        started = time.perf_counter()
        kv = self._pool()
        transfers = [transfer for transfer in pool_transfers or [] if self._known(transfer)]
        checked = [*[self.pages.store_key(key) for key in keys],
                   *[self.pages.store_key(key, self._name(transfer)) for transfer in transfers for key in keys]]
        found = self.pages.existing(checked)
        pools = [PoolPresence(self._name(transfer), _plain(transfer.hit_policy), len(transfer.keys or ()),
                              found[number * len(keys): (number + 1) * len(keys)])
                 for number, transfer in enumerate(transfers, start=1)]
        hits = prefix_hits(found[: len(keys)], pools, kv_name=KV_POOL)
        self.stats.looked_up(len(keys) * kv.page_tokens, {self.store.tier_name: hits.pages * kv.page_tokens},
                             time.perf_counter() - started)
        return PoolTransferResult(hits.pages, hits.per_pool, hits.restorable)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys, name = list(transfer.keys or ()), self._name(transfer)
            pool = self.pools.get(name)
            done = [False] * len(keys)
            if pool is not None and self._indices_fit(transfer, pool):
                done = self.pages.read_pages(pool, keys, self._into_pool(transfer, pool))
            # Transfers of one pool answer in order, in one list: a failure in any shortens its leading run.
            results.setdefault(name, []).extend(done)
        return results

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys, name = list(transfer.keys or ()), self._name(transfer)
            pool = self.pools.get(name)
            if pool is None or not self._indices_fit(transfer, pool):
                done = [False] * len(keys)
            elif not self._writes(pool):
                done = [True] * len(keys)
            else:
                pages = [pool.read(self._host_index(transfer, pool, index)) for index in range(len(keys))]
                done = self.pages.write_pages(pool, keys, pages)
            results.setdefault(name, []).extend(done)
        return results

    @staticmethod
    def _name(transfer: PoolTransfer) -> str:
        return _plain(transfer.name)

    def _known(self, transfer: PoolTransfer) -> bool:
        """A pool whose hit this backend can judge (registered, and a policy it implements)."""
        if self._name(transfer) in self.pools and str(getattr(transfer.hit_policy, "value", "")) in POLICIES:
            return True
        self.pages.warn("pool", "kvgroups HiCache storage: pool %s (%s) is not one it stores; it gets no hit",
                          self._name(transfer), transfer.hit_policy)
        return False

    def _indices_fit(self, transfer: PoolTransfer, pool: PagePool) -> bool:
        keys, indices = transfer.keys or [], transfer.host_indices
        if indices is not None and indices.numel() == len(keys) * pool.page_tokens:
            return True
        self.pages.warn("indices", "kvgroups HiCache storage: pool %s: %s host indices for %d pages of %d",
                          pool.name, "no" if indices is None else indices.numel(), len(keys), pool.page_tokens)
        return False

    def _into_pool(self, transfer: PoolTransfer, pool: PagePool) -> Callable[[int, torch.Tensor], None]:
        """Where a transfer's ``index``-th page goes: its host slot in ``pool``."""
        return lambda index, page: pool.write(self._host_index(transfer, pool, index), page)

    @staticmethod
    def _host_index(transfer: PoolTransfer, pool: PagePool, page: int) -> int:
        indices = transfer.host_indices
        return int(indices[page * pool.page_tokens]) if indices is not None else -1

    # --- what SGLang reports ----------------------------------------------------------------------
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s of each prefetch and backup)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: PLC0415 - SGLang's own

        metrics = StorageMetrics()
        for name, values in self.pages.recent.items():
            getattr(metrics, name).extend(values)
            values.clear()
        return metrics

    def store_key(self, page_hash: str, pool_name: str = KV_POOL) -> str:
        return self.pages.store_key(page_hash, pool_name)

    def close(self) -> None:
        self.pages.close()
