"""One contract for every byte store tier: put/get/contains/delete, batches, LRU under a budget, large
values, threads. The Redis tier runs against real servers (TCP and a unix socket) started here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvgroups import KVGroupsError
from kvgroups.core.sizes import MIB
from kvgroups.store import ByteStore, EntryTooLargeError, FileStore, MemoryStore, TieredStore, open_store
from tests.support.mooncake import MooncakeMaster, running_master
from tests.support.servers import Cluster, Server, running_cluster, running_server

Opener = Callable[[int], ByteStore]  # budget in bytes -> a fresh, empty store


@pytest.fixture(scope="module")
def redis_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    # An LRU budget as the server keeps it: maxmemory, evicting least recently used keys (exactly,
    # with as many samples as the tests have keys).
    settings = ("--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "64")
    with running_server(tmp_path_factory.mktemp("tcp"), settings=settings) as tcp, \
            running_server(tmp_path_factory.mktemp("unix"), unix=True, settings=settings) as unix:
        yield {"redis": tcp, "unix": unix}


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    settings = ("--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "64")
    with running_cluster(tmp_path_factory.mktemp("cluster"), settings=settings) as cluster:
        yield cluster


def _cluster_opener(cluster: Cluster) -> Opener:
    """The cluster as one store, each master keeping the budget, LRU as a server does."""
    def open_with(budget: int) -> ByteStore:
        store = open_store(cluster.url)
        store.clear()
        for port in cluster.masters():
            client = redis.Redis(port=port)
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + budget)
            client.close()
        return store

    return open_with


def _redis_opener(server: Server) -> Opener:
    def open_with(budget: int) -> ByteStore:
        store = open_store(server.url)
        store.clear()
        client = store._client  # type: ignore[attr-defined]
        baseline = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", baseline + budget)
        return store

    return open_with


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    with running_master(tmp_path_factory.mktemp("mooncake")) as master:
        yield master


def _mooncake_opener(master: MooncakeMaster) -> Opener:
    """A pool of this process's segment alone, the budget's size (Mooncake evicts when it fills)."""
    def open_with(budget: int) -> ByteStore:
        store = open_store(master.url(segment=str(max(budget, 64 * MIB))))
        assert store.client.wait_ready(60)  # type: ignore[attr-defined]
        store.clear()
        return store

    return open_with


@pytest.fixture(params=["memory", "file", "redis", "unix", "tiered", "cluster", "mooncake"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    name = request.param
    if name == "memory":
        return MemoryStore
    if name == "file":
        return lambda budget: FileStore(tmp_path / "store", budget)
    if name == "tiered":
        return lambda budget: TieredStore([MemoryStore(budget), FileStore(tmp_path / "tier", budget)])
    if name == "cluster":
        return _cluster_opener(request.getfixturevalue("redis_cluster"))
    if name == "mooncake":
        return _mooncake_opener(request.getfixturevalue("mooncake_master"))
    servers = request.getfixturevalue("redis_servers")
    return _redis_opener(servers[name])


def test_put_get_contains_delete(opener: Opener) -> None:
    with opener(64 * MIB) as store:
        assert store.get("a") is None and not store.contains("a") and not store.delete("a")
        store.put("a", b"first")
        store.put("b", bytearray(b"second"))
        assert store.get("a") == b"first" and store.get("b") == b"second"
        assert store.contains("a") and store.size_of("a") == 5 and store.size_of("zz") is None
        store.put("a", b"replaced")
        assert store.get("a") == b"replaced"
        assert store.get_prefix("a", 3) == b"rep"
        assert store.delete("a") and store.get("a") is None and not store.delete("a")
        assert store.get("b") == b"second"
        assert sorted(store.iter_keys()) == ["b"]
        assert store.stats().entries == 1


def test_get_into_reads_into_the_callers_buffer(opener: Opener) -> None:
    with opener(64 * MIB) as store:
        store.put("a", b"0123456789")
        buffer = bytearray(16)
        value = store.get_into("a", memoryview(buffer))
        assert value is not None and bytes(value) == b"0123456789" and bytes(buffer[:10]) == b"0123456789"
        assert memoryview(value).obj is buffer  # a view of the buffer, whichever the tier
        cut = store.get_into("a", memoryview(bytearray(4)))
        assert cut is not None and len(cut) == 4  # longer than the buffer: it fills the buffer
        assert store.get_into("missing", memoryview(buffer)) is None


def test_batches_and_keys_that_need_escaping(opener: Opener) -> None:
    keys = ["plain", "with space", "slash/and:colon", "ünïcode", "a" * 300]
    with opener(64 * MIB) as store:
        store.put_many([(key, key.encode() * 2) for key in keys])
        assert store.get_many([*keys, "missing"]) == [key.encode() * 2 for key in keys] + [None]
        assert store.contains_many(["missing", *keys]) == [False] + [True] * len(keys)
        assert sorted(store.iter_keys()) == sorted(keys)
        assert store.clear() == len(keys)
        assert store.contains_many(keys) == [False] * len(keys) and list(store.iter_keys()) == []


def test_least_recently_used_goes_first_within_the_budget(opener: Opener) -> None:
    value = 256 * 1024 - 64  # what a server's allocator holds in 256 KiB
    with opener(2 * MIB) as store:
        if store.url.startswith("redis-cluster"):
            pytest.skip("a cluster's LRU is each master's own, not one over all keys: "
                        "tests/store/test_cluster.py::test_each_master_evicts_its_own_least_recently_used")
        if store.url.startswith("mooncake"):
            pytest.skip("Mooncake evicts by its own policy (leases, a share of the pool at a time), not least "
                        "recently used: tests/store/test_mooncake.py::test_a_full_pool_evicts_and_keeps_serving")
        for index in range(4):
            store.put(f"k{index}", bytes([index]) * value)
        if store.url.startswith(("redis", "unix")):
            # A server's LRU clock ticks once a second, and it evicts by its own accounting: use k0
            # a tick after k1..k3 were written, then fill until k1 goes.
            time.sleep(1.1)
            assert store.get("k0") is not None
            time.sleep(1.1)
            index = 4
            while store.contains("k1"):
                assert index < 24, "nothing was evicted"
                store.put(f"k{index}", bytes([index]) * value)
                index += 1
        else:
            for index in range(4, 24):  # three budgets' worth, k0 used after every write
                assert store.get("k0") == bytes([0]) * value
                store.put(f"k{index}", bytes([index]) * value)
            tiers = store.tiers if isinstance(store, TieredStore) else [store]  # each tier keeps its own budget
            assert all(tier.stats().bytes <= 2 * MIB for tier in tiers)
            assert not any(store.contains(f"k{old}") for old in (1, 2, 3, 4, 5))
        assert store.get("k0") == bytes([0]) * value  # used after k1, k2 and k3: still there
        assert store.get(f"k{index}") == bytes([index]) * value or store.contains(f"k{index - 1}")


def test_large_values_and_values_over_the_limit(opener: Opener) -> None:
    large = bytes(range(256)) * (32 * MIB // 256)
    # A server counts its clients' buffers in its memory too (a 32 MiB SET's query buffer): room for both.
    with opener(160 * MIB) as store:
        store.put("large", large)
        assert store.get("large") == large
        store.put_many([("one", large[:MIB]), ("two", large[MIB:2 * MIB])])
        assert store.get_many(["two", "one"]) == [large[MIB:2 * MIB], large[:MIB]]
    with opener(MIB) as small:
        if not small.url.startswith(("redis", "unix", "mooncake")):  # a server's own limit is tested elsewhere
            with pytest.raises(EntryTooLargeError, match=r"exceeds the .* budget of 1048576"):
                small.put("big", bytes(2 * MIB))
            assert not small.contains("big")


def test_concurrent_threads_see_whole_values(opener: Opener) -> None:
    with opener(256 * MIB) as store:
        errors: list[BaseException] = []

        def work(worker: int) -> None:
            try:
                for round_ in range(40):
                    mine = bytes([worker]) * (1000 + round_)
                    store.put(f"own-{worker}-{round_}", mine)
                    shared = bytes([worker]) * 4096
                    store.put("shared", shared)
                    assert store.get(f"own-{worker}-{round_}") == mine
                    seen = store.get("shared")
                    if seen is None:  # Mooncake: a key being written again is unreadable until whole (a miss)
                        assert store.url.startswith("mooncake")
                        continue
                    assert len(seen) == 4096 and seen == bytes([seen[0]]) * 4096
            except BaseException as error:  # reported by the main thread
                errors.append(error)

        threads = [threading.Thread(target=work, args=(worker,)) for worker in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert store.stats().entries == 8 * 40 + 1


def test_a_redis_value_over_the_servers_limit_is_refused(tmp_path: Path) -> None:
    with running_server(tmp_path, settings=("--proto-max-bulk-len", "1mb")) as server, \
            open_store(server.url) as store:
        store.put("fits", bytes(1024))
        with pytest.raises(EntryTooLargeError, match=r"exceeds the server's proto-max-bulk-len of 1048576"):
            store.put("too-big", bytes(2 * MIB))
        assert store.get("fits") == bytes(1024) and not store.contains("too-big")


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://host/x", r"unknown scheme 'ftp'; expected one of memory://, file://"),
    ("memory://?max_bytes=lots", r"max_bytes='lots' is not a size"),
    ("memory://?size=1GiB", r"unknown option 'size'; expected max_bytes"),
    ("file://relative/dir", r"file:// takes a local path"),
    ("file:///tmp/x?ttl=3", r"unknown option 'ttl'"),
    ("redis://localhost:1/0?ttl=-1", r"ttl='-1' must be a positive number"),
    ("redis://localhost:1/zero", r"the path must be a database number"),
    ("unix://?db=0", r"unix:// needs a socket path"),
])
def test_bad_urls_name_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(KVGroupsError, match=message):
        open_store(url)


def test_sizes_take_units_and_lists_are_tiers(tmp_path: Path) -> None:
    store = open_store(["memory://?max_bytes=512MiB", f"file://{tmp_path}/s?max_bytes=2GiB"])
    assert isinstance(store, TieredStore)
    memory, files = store.tiers
    assert isinstance(memory, MemoryStore) and memory.max_bytes == 512 * MIB
    assert isinstance(files, FileStore) and files.max_bytes == 2048 * MIB
    files.put("k", b"value")
    assert store.get("k") == b"value" and memory.get("k") == b"value"  # the hit is copied up


def test_a_tier_that_is_down_costs_only_that_tier(tmp_path: Path) -> None:
    with running_server(tmp_path / "server") as server:
        tiered = open_store(["memory://", server.url])
        tiered.put("k", b"v")
        server.stop()
        assert tiered.get("k") == b"v"  # from memory
        assert tiered.get("other") is None
        tiered.put("k2", b"w")  # memory takes it; the server's failure is logged
        assert tiered.get("k2") == b"w"
        assert tiered.contains_many(["k", "k2", "k3"]) == [True, True, False]
