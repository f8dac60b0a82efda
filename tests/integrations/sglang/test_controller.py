"""kvgroups under SGLang's own HiCache: its radix cache (UnifiedRadixCache) and HybridCacheController, built by
SGLang's `init_hicache` from server arguments with `--hicache-storage-backend dynamic` and kvgroups' extra
config, its storage threads calling the backend. One cache computes a prompt's KV, backs it up to host memory
and on to the store; a second cache, as another server would, prefetches the prompt from the store into its
host pool: the same bytes. What only a GPU does (device-to-host copies, pinned memory) runs on the stand-ins
of gpu_stand_ins.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang.test.kits.unified_radix_cache.fixtures as kit
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache.config import CacheConfig

from kvgroups.store.metrics.prometheus import Collector
from tests.integrations.sglang import gpu_stand_ins
from tests.integrations.sglang.stores import KINDS, fresh_store
from tests.support.paths import ROOT

PAGE = 4
CONFIG = CacheConfig(page_size=PAGE, num_layers=3, full_attention_layer_ids=(0, 1, 2))
PROMPT = list(range(1, 1 + 5 * PAGE))  # five pages


@pytest.fixture(autouse=True)
def one_rank_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SGLang's unit-test topology (one rank, no process group) and device (the kit asks for an accelerator)."""
    gpu_stand_ins.install()
    monkeypatch.setattr(kit, "get_device", lambda: "cpu")
    override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    override.__enter__()
    yield
    override.__exit__(None, None, None)


def hicache(store: str, *, interface_v1: bool, layout: str = "layer_first", config: CacheConfig = CONFIG,
            tp_group: Any = None) -> Any:
    """A radix cache with SGLang's HiCache on kvgroups, as a server's `init_hicache` builds it (one rank of
    ``tp_group``, a process group of the tensor-parallel ranks, where one is given)."""
    cache, allocator, _ = kit.build_fixture(config)
    if tp_group is not None:  # what a scheduler passes in its CacheInitParams
        cache.cache_init_params.tp_cache_group = cache.tp_group = tp_group
        cache.tp_world_size = torch.distributed.get_world_size(group=tp_group)
    extra = {"backend_name": "kvgroups", "module_path": "kvgroups.integrations.sglang",
             "class_name": "KVGroupsHiCacheStorage", "store": store, "prefetch_threshold": 1,
             **({"interface_v1": 1} if interface_v1 else {})}
    arguments = ServerArgs(model_path="dummy", page_size=config.page_size, hicache_io_backend="kernel",
                           hicache_write_policy="write_through", hicache_mem_layout=layout,
                           hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(extra),
                           hicache_storage_prefetch_policy="wait_complete")
    set_global_server_args_for_scheduler(arguments)
    cache.init_hicache(arguments, cache.cache_init_params)
    for entry in cache.cache_controller.mem_pool_host.entries:
        entry.host_pool.pin_memory = False  # no pinned memory without a GPU (gpu_stand_ins.py)
    cache.allocator_for_test = allocator
    return cache


def close(cache: Any) -> None:
    cache.cache_controller._stop_storage_threads()
    kit.drop_hicache_atexit_pin(cache)
    cache.release_host_resources()


def host_pool(cache: Any, name: str = "kv") -> Any:
    return next(entry.host_pool for entry in cache.cache_controller.mem_pool_host.entries if str(entry.name) == name)


def kv_rows(cache: Any, rows: torch.Tensor) -> torch.Tensor:
    """The host pool's K/V (or MLA latent) of token rows ``rows``, layers first, whatever its layout."""
    pool = host_pool(cache)
    if pool.kv_buffer.dim() == 4:  # MLA: [layers, tokens, 1, latent] (layer_first)
        return pool.kv_buffer[:, rows].clone()
    return (pool.kv_buffer[:, :, rows] if pool.layout == "layer_first" else
            pool.kv_buffer[:, rows].transpose(1, 2)).clone()


def until(condition: Any, cache: Any, message: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, message
        cache.drain_storage_control_queues()
        cache.check_hicache_events()
        time.sleep(0.01)


def computed_and_stored(cache: Any, tokens: list[int], config: CacheConfig = CONFIG,
                        seed: int = 0) -> tuple[torch.Tensor, Any]:
    """Insert ``tokens`` with random K/V (drawn from ``seed``) in every attention layer (and, for a hybrid, a
    request's recurrent state), back them up to host memory and on to the store; the host pool's K/V rows for
    them, and the node they end at."""
    allocator = cache.allocator_for_test
    device_rows = allocator.alloc(len(tokens))
    pool = allocator.get_kvcache()
    layers = [layer for layer in config.full_attention_layer_ids] if config.has_mamba else range(config.num_layers)
    generator = torch.Generator().manual_seed(len(tokens) + 1000 * seed)
    for layer in layers:
        buffers = {id(buffer): buffer for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer))}
        for buffer in buffers.values():  # MLA's key and value buffers are one latent buffer
            buffer[device_rows] = torch.randn(buffer[device_rows].shape, generator=generator).to(buffer.dtype)
    key = RadixKey(array("q", tokens))
    params = InsertParams(key=key, value=device_rows)
    if config.has_mamba:  # the state after the last token: a request's slot, filled with random states
        request = kit_request(cache)
        slot = request.kv.mamba_pool_idx
        states = cache.cache_init_params.req_to_token_pool.mamba_pool.get_device_pool_infos()[0].buffer_info
        for buffer in (states.temporal, *states.conv):  # [layers, slots, ...]
            buffer[:, slot] = torch.randn(buffer[:, slot].shape, generator=generator).to(buffer.dtype)
        params.mamba_value = slot.unsqueeze(0)
    cache.insert(params)  # write-through: backed up to host memory
    cache.writing_check(write_back=True)  # the device-to-host copies acknowledged
    node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    host_rows = kit.node_host_value(cache, node, ComponentType.FULL)
    assert host_rows is not None and len(host_rows) == len(tokens)
    in_host = kv_rows(cache, host_rows)
    first_layer_keys = in_host[0] if in_host.dim() == 4 else in_host[0, 0]  # MLA: no K/V axis
    assert torch.equal(first_layer_keys, pool.get_key_buffer(layers[0])[device_rows])
    cache.write_backup_storage(node)
    until(lambda: not cache.ongoing_backup, cache, "the backup to the store did not finish")
    return in_host, node


def kit_request(cache: Any) -> Any:
    """A request holding a recurrent-state slot in the cache's request pool, as the scheduler makes one."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    request = Req(rid="producer", origin_input_text="", origin_input_ids=array("q"),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    cache.cache_init_params.req_to_token_pool.alloc([request])
    return request


def prefetched(cache: Any, tokens: list[int]) -> tuple[int, torch.Tensor | None]:
    """Prefetch ``tokens`` from the store as SGLang's scheduler does for a new request: the tokens now in host
    memory, and their rows there."""
    request = CacheRequestHandle("returning", 0)
    cache.prefetch_from_storage(request, cache.root_node_handle(), array("q", tokens), None, None)
    until(lambda: cache.check_prefetch_progress(request), cache, "the prefetch did not finish")
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    if not match.host_hit_length:
        return 0, None
    rows = kit.node_host_value(cache, match.last_host_node, ComponentType.FULL)
    return match.host_hit_length, kv_rows(cache, rows)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("write_v1", "read_v1"), [(False, False), (True, True), (True, False)],
                         ids=["generic", "v1", "v1-then-generic"])
def test_a_prompt_one_server_stored_is_prefetched_by_another_byte_for_byte(kind: str, write_v1: bool, read_v1: bool,
                                                                         tmp_path: Path,
                                                                         request: pytest.FixtureRequest) -> None:
    store = fresh_store(kind, tmp_path, request)
    producer = hicache(store, interface_v1=write_v1)
    try:
        stored, _ = computed_and_stored(producer, PROMPT)
        assert producer.cache_controller.storage_backend.stats.saved_chunks == len(PROMPT) // PAGE
    finally:
        close(producer)
    consumer = hicache(store, interface_v1=read_v1)
    try:
        hit, rows = prefetched(consumer, PROMPT)
        assert hit == len(PROMPT) and rows is not None and torch.equal(rows, stored)
        backend = consumer.cache_controller.storage_backend
        assert backend.stats.loaded_tokens == len(PROMPT)
        exported = {family.name: family for family in Collector().collect()}  # kvgroups' Prometheus collector
        loaded = {sample.labels["tier"]: sample.value for sample in exported["kvgroups_loaded_tokens"].samples
                  if sample.name == "kvgroups_loaded_tokens_total"}
        assert loaded[backend.store.tier_name] >= len(PROMPT)
        assert {sample.name for sample in exported["kvgroups_load_seconds"].samples} >= {
            "kvgroups_load_seconds_count", "kvgroups_load_seconds_sum"}
    finally:
        close(consumer)


def test_a_damaged_page_ends_the_prefetch_there_and_the_rest_is_computed(tmp_path: Path) -> None:
    store = f"file://{tmp_path}/kv"
    producer = hicache(store, interface_v1=True)
    try:
        stored, _ = computed_and_stored(producer, PROMPT)
        third_page = producer.cache_controller.storage_backend.store_key(
            producer.tree_core.get_hash_values(producer.match_prefix(MatchPrefixParams(
                key=RadixKey(array("q", PROMPT)))).last_device_node)[2])
    finally:
        close(producer)
    # The file whose entry names that page's key (an entry's header holds its key).
    target = next(path for path in (tmp_path / "kv").rglob("*") if path.is_file() and third_page.encode() in
                  path.read_bytes())
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x01
    target.write_bytes(bytes(data))
    consumer = hicache(store, interface_v1=True)
    try:
        hit, rows = prefetched(consumer, PROMPT)
        assert hit == 2 * PAGE and rows is not None and torch.equal(rows, stored[:, :, : 2 * PAGE])
        assert consumer.cache_controller.storage_backend.stats.corrupt_entries == 1
    finally:
        close(consumer)


HYBRID = CacheConfig(page_size=1, num_layers=4, full_attention_layer_ids=(1, 3),
                     components=(ComponentType.FULL, ComponentType.MAMBA))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
def test_a_hybrid_prompt_is_prefetched_with_its_recurrent_state(kind: str, interface_v1: bool, tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    """A gated-DeltaNet-like hybrid (2 attention and 2 recurrent layers; SGLang keeps recurrent states with
    one-token pages): the KV pages and the state at the prompt's end go to the store through SGLang's v2
    calls, and another cache gets both back, the state as it was."""
    tokens = list(range(1, 9))
    store = fresh_store(kind, tmp_path, request)
    producer = hicache(store, interface_v1=interface_v1, layout="page_first", config=HYBRID)
    try:
        stored, node = computed_and_stored(producer, tokens, HYBRID)
        slot = kit.node_host_value(producer, node, ComponentType.MAMBA)
        state = host_pool(producer, "mamba").get_data_page(int(slot[0])).clone()
        assert state.any()  # the random state reached host memory
        assert producer.cache_controller.storage_backend.stats.saved_chunks == len(tokens) + 1
    finally:
        close(producer)
    consumer = hicache(store, interface_v1=interface_v1, layout="page_first", config=HYBRID)
    try:
        hit, rows = prefetched(consumer, tokens)
        assert hit == len(tokens) and rows is not None and torch.equal(rows, stored)
        match = consumer.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        assert match.mamba_host_hit_length == 1
        their_slot = kit.node_host_value(consumer, match.last_host_node, ComponentType.MAMBA)
        assert torch.equal(host_pool(consumer, "mamba").get_data_page(int(their_slot[0])), state)
    finally:
        close(consumer)


PRODUCER = """
import sys
from tests.integrations.sglang import torchvision_stand_in
torchvision_stand_in.install()
from sglang.srt.runtime_context import get_parallel
import sglang.test.kits.unified_radix_cache.fixtures as kit
from tests.integrations.sglang import gpu_stand_ins
from tests.integrations.sglang.test_controller import PROMPT, close, computed_and_stored, hicache
from safetensors.torch import save_file
gpu_stand_ins.install()
kit.get_device = lambda: "cpu"
with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
    producer = hicache(sys.argv[1], interface_v1=True)
    stored, _ = computed_and_stored(producer, PROMPT)
    close(producer)
save_file({"kv": stored.contiguous()}, sys.argv[2])  # what the producer stored, for the test to compare
"""


def test_a_prompt_another_process_stored_is_prefetched_here(tmp_path: Path) -> None:
    """The producer is another process (as another server would be): its storage threads write, ours read."""
    store, expected = f"file://{tmp_path}/kv", tmp_path / "expected.safetensors"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    produced = subprocess.run([sys.executable, "-c", PRODUCER, store, str(expected)], capture_output=True,
                              text=True, env=environment, timeout=300, check=False)
    assert produced.returncode == 0, produced.stderr[-3000:]
    consumer = hicache(store, interface_v1=True)
    try:
        hit, rows = prefetched(consumer, PROMPT)
        assert hit == len(PROMPT) and rows is not None
        assert torch.equal(rows, load_file(expected)["kv"])
    finally:
        close(consumer)


def mla_device_pool(**arguments: Any) -> Any:
    """What the kit's fixture builds as its device pool, as an MLA pool (a 16-dim latent, 4 rope dims)."""
    return MLATokenToKVPool(size=arguments["size"], page_size=arguments["page_size"], dtype=arguments["dtype"],
                            kv_lora_rank=16, qk_rope_head_dim=4, layer_num=arguments["layer_num"],
                            device=arguments["device"], enable_memory_saver=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
def test_an_mla_prompt_is_prefetched_by_another_server(kind: str, interface_v1: bool, tmp_path: Path,
                                                       request: pytest.FixtureRequest,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLA model: SGLang's controller sees an MLA device pool, builds an MLA host pool, and one rank's latent
    rows go to the store and come back."""
    monkeypatch.setattr(kit, "MHATokenToKVPool", mla_device_pool)
    store = fresh_store(kind, tmp_path, request)
    producer = hicache(store, interface_v1=interface_v1)
    try:
        assert type(host_pool(producer)).__name__ == "MLATokenToKVPoolHost"
        stored, _ = computed_and_stored(producer, PROMPT)
        assert stored.any() and producer.cache_controller.storage_backend.stats.saved_chunks == len(PROMPT) // PAGE
    finally:
        close(producer)
    consumer = hicache(store, interface_v1=interface_v1)
    try:
        hit, rows = prefetched(consumer, PROMPT)
        assert hit == len(PROMPT) and rows is not None and torch.equal(rows, stored)
    finally:
        close(consumer)


def two_ranks(tmp_path: Path, write_stores: tuple[str, str], read_store: str) -> list[tuple[int, Any, Any]]:
    """Both ranks of a two-rank server (tp_rank.py), each storing its shard in its ``write_stores`` entry, then
    prefetching from ``read_store``: per rank, the tokens it hit, what it stored and what it read."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    init_file = tmp_path / f"rendezvous-{time.monotonic_ns()}"
    outs = [tmp_path / f"rank{rank}-{time.monotonic_ns()}.safetensors" for rank in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.integrations.sglang.tp_rank", str(rank), str(init_file),
                               write_stores[rank], read_store, str(outs[rank])], cwd=ROOT, env=environment,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(log[-3000:] for log in logs)
    results = []
    for out in outs:
        tensors = load_file(out)
        with safe_open(out, "pt") as handle:
            hit = json.loads(handle.metadata()["hit"])
        results.append((hit, tensors["stored"], tensors.get("read")))
    return results


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_two_tensor_parallel_ranks_each_read_back_their_own_shard_through_sglangs_controller(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two ranks of one server (two processes, SGLang's controller agreeing on hits over a gloo group) store their
    shards of one prompt in one store under the same page hashes; a fresh cache of each reads back its own shard
    (the two differ), never the other rank's."""
    store = fresh_store(kind, tmp_path, request)
    (hit0, stored0, read0), (hit1, stored1, read1) = two_ranks(tmp_path, (store, store), store)
    assert not torch.equal(stored0, stored1)
    assert hit0 == hit1 == len(PROMPT)
    assert torch.equal(read0, stored0) and torch.equal(read1, stored1)


def test_a_rank_whose_shard_is_not_stored_hits_nothing_and_nor_does_the_other(tmp_path: Path) -> None:
    """Rank 1 stored its shard elsewhere: in the store rank 0 wrote, rank 1 finds none of its pages (rank 0's
    pages, under the same page hashes, are not its own), and SGLang's controller, taking the smallest hit of the
    ranks, prefetches nothing on either: no rank ever computes on another rank's heads."""
    shared, elsewhere = f"file://{tmp_path}/shared", f"file://{tmp_path}/rank1-elsewhere"
    (hit0, _, read0), (hit1, _, read1) = two_ranks(tmp_path, (shared, elsewhere), shared)
    assert hit0 == hit1 == 0
    assert read0 is None and read1 is None
