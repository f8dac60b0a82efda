"""DeepSeek-V4 under SGLang's HiCache (0.5.23) on kvgroups, through SGLang's own code on the CPU.

SGLang's own DeepSeek-V4 device pool (``DeepSeekV4TokenToKVPool``) and HiCache stack (its ``_DeepSeekV4Strategy``:
a logical anchor as the ``kv`` pool, byte-page pools for the window, the compressed rows, the indexer keys and the
compressor rings, its ``HybridCacheController``), with kvgroups attached by SGLang's own code. One stack backs a
prefix up to the store through its controller's storage code (``_page_backup``: the pools beside the anchor with
``batch_set_v2``, then the anchor's pages); another, as a second server would, asks the store what it holds
(``_storage_hit_query``: ``batch_exists_v2``), takes host memory for the hit (``allocate_storage_hit``) and
prefetches it (``_page_transfer``: the anchor and the pools read with its pages, then the window and the rings at
the prefix's end): every pool's bytes as the first held them. The transfers are built as SGLang's radix cache
builds them (``_build_sidecar_transfers``; the window's as its SWA component does). The host pools' bytes are
drawn at random where a GPU's device-to-host copies would have put the model's (SGLang's DeepSeek-V4 copies need
CUDA kernels).
"""

from __future__ import annotations

from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _DeepSeekV4Strategy
from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase, ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from kvgroups.integrations.sglang.pools import UnsupportedPoolError
from tests.integrations.sglang import gpu_stand_ins

PAGE = 256  # SGLang's page for DeepSeek-V4 (its server forces it)
RATIOS = [0, 0, 4, 128, 4]  # two window-only layers, CSA (ratio 4, an indexer), HCA (ratio 128), CSA
PROMPT = [(index * 37 + 11) % 1000 for index in range(3 * PAGE)]  # three pages


@pytest.fixture(autouse=True)
def one_rank_on_the_cpu() -> Any:
    gpu_stand_ins.install()
    override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    override.__enter__()
    yield
    override.__exit__(None, None, None)


class Server:
    """One server's DeepSeek-V4 HiCache stack, as SGLang's init_hicache builds it, on kvgroups."""

    def __init__(self, store: str, *, layout: str = "page_first", interface_v1: bool = True) -> None:
        extra = {"backend_name": "kvgroups", "module_path": "kvgroups.integrations.sglang",
                 "class_name": "KVGroupsHiCacheStorage", "store": store,
                 **({"interface_v1": 1} if interface_v1 else {})}
        arguments = ServerArgs(model_path="dummy", page_size=PAGE, hicache_io_backend="direct",
                               hicache_write_policy="write_through", hicache_mem_layout=layout,
                               hicache_storage_backend="dynamic", hicache_ratio=2.0)
        set_global_server_args_for_scheduler(arguments)
        tokens = 8 * PAGE
        self.device_pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=tokens, c4_size=tokens, c128_size=tokens, c4_state_pool_size=tokens,
            c128_state_pool_size=tokens, page_size=PAGE, swa_page_size=PAGE, dtype=torch.uint8,
            c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
            indexer_head_dim=128, layer_num=len(RATIOS), device="cpu", enable_memory_saver=False,
            compression_ratios=RATIOS, start_layer=0, end_layer=len(RATIOS))
        allocator = SWATokenToKVPoolAllocator(size=tokens, size_swa=tokens, page_size=PAGE, dtype=torch.uint8,
                                              device="cpu", kvcache=self.device_pool, need_sort=False)
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                                 page_size=PAGE, sliding_window_size=128)
        # What the strategy reads of the radix cache: its components (no C128 component: a GPU's), its evictions.
        tree = SimpleNamespace(components={ComponentType.FULL: None, ComponentType.SWA: None},
                               evict_host=lambda *_: 0)
        built = _DeepSeekV4Strategy().build(
            cache=tree, kvcache=self.device_pool, params=params, server_args=arguments, load_cache_event=None,
            storage_backend="dynamic", storage_backend_extra_config=extra, model_name="deepseek-v4-tiny")
        self.controller, self.pools = built.cache_controller, built.host_pool_group
        self.controller._stop_storage_threads()  # the test calls the storage code itself, in SGLang's order
        self.sidecar_pool_specs = built.sidecars
        self.backend = self.controller.storage_backend

    def pool(self, name: Any) -> Any:
        return self.pools.entry_map[name].host_pool

    def transfers(self, phase: Any, kv: PoolTransfer, window: PoolTransfer) -> list[PoolTransfer]:
        """What SGLang's radix cache hands the controller: the window's transfer and every sidecar's."""
        sidecars = UnifiedRadixCache._build_sidecar_transfers(self, phase, kv, {ComponentType.SWA: [window]})
        return [window, *sidecars]

    def fill(self, seed: int) -> None:
        """Every host page of every byte pool drawn at random (what the device-to-host copies would put there)."""
        generator = torch.Generator().manual_seed(seed)
        for entry in self.pools.entries:
            buffers = entry.host_pool.kv_buffer
            for buffer in buffers if isinstance(buffers, list) else [] if buffers is None else [buffers]:
                buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=generator))

    def page(self, name: Any, index: int) -> torch.Tensor:
        return self.pool(name).get_data_page(index, flat=True).clone()

    def close(self) -> None:
        self.backend.close()


def page_hashes(tokens: list[int]) -> list[str]:
    """SGLang's keys of the pages of ``tokens`` (its controller's own)."""
    return list(get_storage_hash_str(tokens, None, page_size=PAGE))


def backed_up(server: Server, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``tokens`` in host memory (anchor slots, and the window's last page) and backed up to the store through the
    controller's storage code; the host slots of each."""
    hashes = page_hashes(tokens)
    slots = server.pool(PoolName.KV).alloc(len(tokens))
    window_slots = server.pool(PoolName.SWA).alloc(PAGE)  # the window's: its last page's, as its component keeps
    kv = PoolTransfer(name=PoolName.KV, host_indices=slots, keys=hashes)
    window = PoolTransfer(name=PoolName.SWA, host_indices=window_slots, keys=hashes[-1:],
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)
    operation = StorageOperation(slots, array("q", tokens), hash_value=hashes,
                                 pool_transfers=server.transfers(CacheTransferPhase.BACKUP_STORAGE, kv, window))
    server.controller._page_backup(operation)
    assert operation.completed_tokens == len(tokens)
    return slots, window_slots, hashes


def prefetched(server: Server, tokens: list[int]) -> tuple[int, PrefetchOperation]:
    """A prefetch of ``tokens`` as SGLang's controller runs one: the store asked, host memory taken for the hit,
    the pages read; how many tokens it restored."""
    kv = PoolTransfer(name=PoolName.KV, host_indices=None)
    window = PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    operation = PrefetchOperation(CacheRequestHandle("returning", 0), array("q", tokens), None,
                                  pool_transfers=server.transfers(CacheTransferPhase.PREFETCH, kv, window))
    hashes, hit_tokens = server.controller._storage_hit_query(operation)
    if not hit_tokens:
        return 0, operation
    operation.hash_value = hashes
    host_indices, _ = server.controller.allocate_storage_hit(operation, hit_tokens, allow_partial=False,
                                                             min_tokens=hit_tokens, evict_host=lambda _: 0)
    assert host_indices is not None
    operation.host_indices = host_indices
    window.host_indices = server.pool(PoolName.SWA).alloc(PAGE)
    server.controller._page_transfer(operation)
    # What the controller acknowledges to its sync thread: the tokens the anchor and the pools read with it
    # restored, then which pages of the window and the rings it read at the prefix's end.
    acks = []
    while not server.controller.prefetch_sync_queue.empty():
        acks.append(server.controller.prefetch_sync_queue.get())
    operation.sidecar_pages = {str(name): pages for ack in acks for name, pages in (ack.pool_hits or {}).items()}
    return sum(ack.completed_tokens or 0 for ack in acks), operation


def test_sglang_registers_every_deepseek_v4_pool_and_kvgroups_describes_each(tmp_path: Path) -> None:
    server = Server(f"file://{tmp_path}/kv")
    try:
        assert sorted(server.backend.pools) == sorted(str(entry.name) for entry in server.pools.entries) == [
            "deepseek_v4_c128", "deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c4_indexer_state",
            "deepseek_v4_c4_state", "kv", "swa"]
        assert server.backend.pools["kv"].page_numel == 0  # the anchor: a marker per page
    finally:
        server.close()


def test_a_prefix_one_server_backed_up_is_prefetched_by_another_pool_by_pool_byte_for_byte(tmp_path: Path) -> None:
    store = f"file://{tmp_path}/kv"
    first = Server(store)
    first.fill(seed=1)
    slots, window_slots, _ = backed_up(first, PROMPT)
    second = Server(store)
    second.fill(seed=2)
    try:
        restored, operation = prefetched(second, PROMPT)
        assert restored == len(PROMPT)
        assert operation.sidecar_pages == {"swa": 1, "deepseek_v4_c4_state": 1, "deepseek_v4_c4_indexer_state": 1}
        compared = set()
        for transfer in operation.pool_transfers:
            if PoolName.SWA in (transfer.name, transfer.indices_from_pool):
                pages = [(int(window_slots[0]), int(transfer.host_indices[0]))]  # the window's last page
            else:
                pages = [(int(slots[page * PAGE]), int(operation.host_indices[page * PAGE])) for page in range(3)]
            for ours, theirs in pages:
                assert torch.equal(first.page(transfer.name, ours), second.page(transfer.name, theirs)), transfer.name
            compared.add(str(transfer.name))
        assert compared == set(second.backend.pools) - {"kv"}
    finally:
        first.close()
        second.close()


def test_a_subclass_of_a_deepseek_v4_pool_is_refused_by_name(tmp_path: Path) -> None:
    """QSA's indexer pool subclasses DeepSeek-V4's paged pool: kvgroups stores those pages only as exactly that
    class, and SGLang refuses to start rather than store bytes nobody checked."""
    server = Server(f"file://{tmp_path}/kv")
    try:
        c4 = server.pool(PoolName.DEEPSEEK_V4_C4)
        subclass = type("QSAIndexerPoolHost", (type(c4),), {})
        c4.__class__ = subclass
        with pytest.raises(UnsupportedPoolError, match="'qsa_indexer' of type QSAIndexerPoolHost: a subclass of "
                                                       "DeepSeekV4PagedHostPool"):
            server.backend.register_mem_host_pool_v2(c4, "qsa_indexer")
    finally:
        server.close()


def test_a_damaged_window_page_is_a_counted_miss_of_its_pool_and_the_prefix_is_read_without_it(tmp_path: Path) -> None:
    """A flipped byte in the stored window page: the prefetch reads the prefix's pages and reports the window's page
    unread (SGLang then treats the window as absent); the damaged entry is counted, deleted, and raises nothing."""
    store = tmp_path / "kv"
    first = Server(f"file://{store}")
    first.fill(seed=1)
    _, _, hashes = backed_up(first, PROMPT)
    key = first.backend.store_key(hashes[-1], "swa").encode()
    entry = next(path for path in store.rglob("*") if path.is_file() and key in path.read_bytes())  # its header
    data = bytearray(entry.read_bytes())
    data[-5] ^= 0x01
    entry.write_bytes(bytes(data))
    second = Server(f"file://{store}")
    try:
        restored, operation = prefetched(second, PROMPT)
        assert restored == len(PROMPT)
        assert operation.sidecar_pages["swa"] == 0
        assert second.backend.stats.corrupt_entries == 1
    finally:
        first.close()
        second.close()


def test_pages_stored_under_another_row_layout_are_not_hit(tmp_path: Path) -> None:
    """SGLang's DeepSeek-V4 row layout (``SGLANG_DSV4_KV_LAYOUT``: V4.1's orders the same bytes otherwise) is part of
    every byte pool's fingerprint: a server on another layout finds nothing."""
    from sglang.srt.environ import envs

    store = f"file://{tmp_path}/kv"
    first = Server(store)
    first.fill(seed=1)
    backed_up(first, PROMPT)
    with envs.SGLANG_DSV4_KV_LAYOUT.override("v41"):
        second = Server(store)
    third = Server(store)
    try:
        assert prefetched(second, PROMPT)[0] == 0
        assert prefetched(third, PROMPT)[0] == len(PROMPT)  # the same layout hits
    finally:
        for server in (first, second, third):
            server.close()


def test_pools_kvgroups_does_not_store_yet_and_a_lone_anchor_are_refused_by_name(tmp_path: Path) -> None:
    """V4.1's pools (another pool name on the same class) are refused naming the pool and the ones stored; a logical
    anchor with none of DeepSeek-V4's pools beside it is refused once SGLang has registered every pool."""
    from kvgroups.integrations.sglang.storage import KVGroupsHiCacheStorage

    server = Server(f"file://{tmp_path}/kv")
    try:
        c4 = server.pool(PoolName.DEEPSEEK_V4_C4)
        with pytest.raises(UnsupportedPoolError, match="'deepseek_v4_c1' of type DeepSeekV4PagedHostPool: kvgroups "
                                                       "stores DeepSeek-V4's pools swa"):
            server.backend.register_mem_host_pool_v2(c4, PoolName.DEEPSEEK_V4_C1)
        alone = KVGroupsHiCacheStorage(server.controller.storage_config)  # as SGLang builds one
        alone.register_mem_pool_host(server.pool(PoolName.KV))
        with pytest.raises(UnsupportedPoolError, match="a logical anchor pool and none of DeepSeek-V4's pools"):
            alone.on_host_pools_registered()
        alone.close()
    finally:
        server.close()
