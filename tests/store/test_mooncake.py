"""The Mooncake tier on a real master (``mooncake_master`` on loopback): a pool another process lends memory to,
and the faults users fear, each a miss and never a failed request or a wrong value: the master killed and
started again, hung, the lending client killed, the pool full, a flipped byte. Its batch contract is
tests/store/test_contract.py's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvgroups.core.sizes import MIB
from kvgroups.errors import KVGroupsError
from kvgroups.store import KVChunkStore, StoreError, open_store
from kvgroups.store.backends.mooncake.settings import P2P_HANDSHAKE, parse_mooncake_url
from kvgroups.store.backends.mooncake.store import MooncakeStore
from kvgroups.store.metrics.counters import Registry
from kvgroups.store.metrics.prometheus import Collector
from tests.support.mooncake import CLIENT_TTL_SECONDS, MooncakeMaster, lending_client, running_master
from tests.support.stored_chunks import MIXED_KINDS, build_metadata, chunk_tensors, prompts, save_all


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with running_master(tmp_path / "master") as started:
        yield started


def _open(url: str) -> MooncakeStore:
    store = open_store(url)
    assert isinstance(store, MooncakeStore) and store.client.wait_ready(60)
    return store


def _expected(store: KVChunkStore, tokens: list[int]) -> list[list[torch.Tensor]]:
    return [chunk_tensors(store, tokens, chunk) for chunk in range(len(store.keys(tokens)))]


def test_a_url_takes_every_option_and_defaults_to_peer_handshakes() -> None:
    settings = parse_mooncake_url("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&segment=4GiB"
                                  "&buffer=32MiB&replicas=2&timeout=0.5&local_host=10.0.0.9")
    assert (settings.master, settings.metadata, settings.segment_bytes, settings.buffer_bytes) == (
        "10.0.0.5:50051", "http://10.0.0.5:8080/metadata", 4 << 30, 32 * MIB)
    assert (settings.replicas, settings.timeout_seconds, settings.client_host()) == (2, 0.5, "10.0.0.9")
    assert settings.admin == "http://10.0.0.5:9003" and settings.protocol == "tcp"
    bare = parse_mooncake_url("mooncake://127.0.0.1")
    assert (bare.master, bare.metadata, bare.client_host()) == ("127.0.0.1:50051", P2P_HANDSHAKE, "127.0.0.1")


@pytest.mark.parametrize(("url", "messages"), [
    ("mooncake://?segment=1GiB", ["no master host"]),
    ("mooncake://h:1?segment=lots&replicas=0&timeout=-1&protocol=udp",
     ["segment='lots' is not a size", "replicas='0' must be a whole number >= 1", "timeout='-1' must be a finite",
      "protocol='udp'; expected tcp or rdma"]),
    ("mooncake://h:1?metadata=etcd://x&device=mlx5_0", ["metadata='etcd://x'; expected P2PHANDSHAKE",
                                                         "device='mlx5_0' names RDMA devices: it takes protocol=rdma"]),
    ("mooncake://h:1?segments=1GiB", ["unknown option 'segments'; expected metadata, segment"]),
    ("mooncake://user:pw@h:1/x", ["takes no user or password", "no path after the master"]),
])
def test_a_bad_url_names_every_wrong_part(url: str, messages: list[str]) -> None:
    with pytest.raises(KVGroupsError) as raised:
        open_store(url)
    for message in messages:
        assert message in str(raised.value)
    assert "pw" not in str(raised.value).replace("pw@", "")  # the only secret a URL could hold is not repeated


def test_a_second_process_lends_the_pool_and_its_entries_leave_with_it(master: MooncakeMaster) -> None:
    """This process lends nothing (segment=0): every entry lives in the lender's memory, moved over TCP through
    the master's HTTP metadata server. Killed, the lender takes them along: lookups that promised them find
    them gone (counted as vanished), loads serve what is left, never an error or a wrong tensor."""
    metadata = build_metadata(MIXED_KINDS)
    with lending_client(master.url(segment="64MiB", metadata=True)) as lender:
        store = KVChunkStore(metadata, master.url(segment="0", metadata=True))
        assert store.store.client.wait_ready(60)  # type: ignore[attr-defined]
        first = prompts(1)[0]
        save_all(store, [first])
        assert store.lookup(first) == 40
        loaded = store.load_entries(first, 40)
        assert loaded.num_tokens == 40 and loaded.entries
        expected = _expected(store, first)
        for (group, chunk), tensor in loaded.entries.items():
            assert torch.equal(tensor, expected[chunk][group])
        stored = sorted(store.store.iter_keys())
        assert stored and sorted(key.removeprefix("kvgroups:") for key in master.stored_keys()) == stored
        lender.kill()
        lender.wait(timeout=30)
        deadline = time.monotonic() + 10 * CLIENT_TTL_SECONDS
        while store.lookup(first) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.lookup(first) == 0 and store.load(first, 40).num_tokens == 0
        assert store.stats.vanished_entries > 0 and store.stats.corrupt_entries == 0
        store.close()


def test_a_master_killed_is_backed_off_once_and_served_again_once_restarted(master: MooncakeMaster,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvgroups.store.backends.health.RETRY_AFTER_SECONDS", 1.0)
    store = KVChunkStore(build_metadata(MIXED_KINDS), master.url())
    assert store.store.client.wait_ready(60)  # type: ignore[attr-defined]
    first, second = prompts(2)
    save_all(store, [first])
    assert store.lookup(first) == 40
    master.process.kill()
    master.process.wait(timeout=30)
    begin = time.monotonic()
    assert [store.lookup(first) for _ in range(20)] == [0] * 20  # misses, not errors
    assert time.monotonic() - begin < 2.0  # backed off after the first: no call waits on a dead master
    assert store.stats.failed_reads == 1
    master.restart()  # a new master knows nothing: what it held is gone, the client mounts its memory again
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        save_all(store, [second])
        if store.lookup(second) == 40:
            break
        time.sleep(0.5)
    assert store.lookup(second) == 40 and store.load(second, 40).num_tokens == 40
    assert store.lookup(first) == 0
    store.close()


def test_a_hung_master_costs_one_timeout_per_back_off(master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvgroups.store.backends.health.RETRY_AFTER_SECONDS", 60.0)
    store = KVChunkStore(build_metadata(MIXED_KINDS), master.url(timeout=0.5))
    assert store.store.client.wait_ready(60)  # type: ignore[attr-defined]
    tokens = prompts(1)[0]
    save_all(store, [tokens])
    master.pause()
    try:
        begin = time.monotonic()
        assert [store.lookup(tokens) for _ in range(10)] == [0] * 10
        assert store.load(tokens, 40).num_tokens == 0
        elapsed = time.monotonic() - begin
        assert 0.5 <= elapsed < 1.5  # one timeout, then misses at once
        assert store.stats.failed_reads == 1
        assert store.store.tier_metrics.errors["timeout"] == 1
    finally:
        master.resume()
    store.close()


def test_a_full_pool_evicts_and_keeps_serving(master: MooncakeMaster) -> None:
    """Six times the pool's size written: Mooncake evicts (or refuses a write, counted); every read is the
    value written or a miss, the newest are there, and nothing is over the pool."""
    with _open(master.url(segment="64MiB")) as store:
        failed = 0
        for batch in range(24):
            try:
                store.put_many([(f"v{batch}-{index}", bytes([batch, index]) * (MIB // 2)) for index in range(16)])
            except StoreError:
                failed += 1
            time.sleep(0.05)
        values = store.get_many([f"v{batch}-{index}" for batch in range(24) for index in range(16)], MIB)
        kept = [(batch, index) for batch in range(24) for index in range(16)
                if values[batch * 16 + index] is not None]
        for batch, index in kept:
            assert values[batch * 16 + index] == bytes([batch, index]) * (MIB // 2)
        assert 0 < len(kept) <= 64 and failed < 24
        assert store.stats().bytes <= 64 * MIB


def test_a_flipped_byte_is_a_counted_miss_and_the_copy_is_deleted(master: MooncakeMaster) -> None:
    store = KVChunkStore(build_metadata(MIXED_KINDS), master.url())
    assert store.store.client.wait_ready(60)  # type: ignore[attr-defined]
    tokens = prompts(1)[0]
    save_all(store, [tokens])
    damaged = store.entry_key(store.keys(tokens)[0], 0)
    value = bytearray(store.store.get(damaged) or b"")
    value[len(value) // 2] ^= 0x01
    with _open(master.url(segment="0")) as other:  # another client of the pool flips it
        other.put(damaged, bytes(value))
    assert store.load(tokens, 40).num_tokens == 0
    assert store.stats.corrupt_entries == 1 and not store.store.contains(damaged)
    store.close()


def test_a_file_tier_in_front_of_mooncake_and_the_tiers_metrics(master: MooncakeMaster, tmp_path: Path) -> None:
    store = KVChunkStore(build_metadata(MIXED_KINDS), [f"file://{tmp_path}/front", master.url()])
    front, pool = store.store.tiers
    assert isinstance(pool, MooncakeStore) and pool.client.wait_ready(60)
    tokens = prompts(1)[0]
    save_all(store, [tokens])
    front.clear()
    assert store.lookup(tokens) == 40 and store.load(tokens, 40).num_tokens == 40
    assert store.stats.hit_tokens_by_tier.get("mooncake") == 40
    stores = Registry()
    stores.add(store, store.stats)
    registry = CollectorRegistry()
    registry.register(Collector(stores))
    hits = registry.get_sample_value("kvgroups_tier_hits_total", {"tier": "mooncake"})
    assert hits is not None and hits > 0
    store.close()


def test_store_stats_lists_the_pool_through_the_masters_admin_server(master: MooncakeMaster) -> None:
    store = KVChunkStore(build_metadata(MIXED_KINDS), master.url())
    assert store.store.client.wait_ready(60)  # type: ignore[attr-defined]
    save_all(store, [prompts(1)[0]])
    entries = len(list(store.store.iter_keys()))
    done = subprocess.run([sys.executable, "-m", "kvgroups", "store", "stats", master.url(segment="0"), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["entries"] == entries > 0
    store.close()
