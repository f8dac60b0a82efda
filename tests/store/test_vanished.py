"""Entries that vanish under the store (deleted, evicted or lost by a server behind its back) are counted when a
lookup finds them missing, each once, and only when the lookup could ask for them; a write a Valkey/Redis
server's replicas did not acknowledge (``wait_replicas``) is a failed save, not a saved one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvgroups.errors import KVGroupsError
from kvgroups.store import KVChunkStore, open_store
from kvgroups.store.backends.redis.settings import parse_redis_url
from kvgroups.store.chunks.seen import SeenEntries
from kvgroups.store.metrics.counters import Registry
from kvgroups.store.metrics.prometheus import Collector
from tests.support.servers import Server, running_server
from tests.support.stored_chunks import MIXED_KINDS, build_metadata, prompts, save_all

OPERATIONS = st.lists(st.tuples(st.sampled_from(("stored", "vanished", "forget")),
                                st.lists(st.integers(0, 12), max_size=6)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(operations=OPERATIONS, capacity=st.integers(1, 8))
def test_seen_entries_count_each_known_key_once_and_keep_the_most_recent(
        operations: list[tuple[str, list[int]]], capacity: int) -> None:
    seen, model = SeenEntries(capacity), list[str]()  # the model: keys known, least recently seen first
    for operation, numbers in operations:
        keys = [f"k{number}" for number in numbers]
        if operation == "stored":
            seen.stored(keys)
            for key in keys:
                if key in model:
                    model.remove(key)
                model.append(key)
            del model[:max(len(model) - capacity, 0)]
        elif operation == "vanished":
            expected = 0
            for key in keys:
                if key in model:
                    model.remove(key)
                    expected += 1
            assert seen.vanished(keys) == expected
        else:
            seen.forget(keys)
            model = [key for key in model if key not in keys]
    assert seen.vanished(f"k{number}" for number in range(13)) == len(model)


def test_entries_deleted_behind_the_store_are_counted_once_and_a_discarded_corrupt_one_is_not(tmp_path: Path) -> None:
    store = KVChunkStore(build_metadata(MIXED_KINDS), f"file://{tmp_path}/kv")
    first, second = prompts(2)
    save_all(store, [first, second])
    assert store.lookup(first) == 40 and store.stats.vanished_entries == 0
    keys = store.keys(first)
    gone = [store.entry_key(keys[4], 0), store.entry_key(keys[4], 2)]  # the last chunk's full and recurrent entries
    for key in gone:
        store.store.delete(key)  # as another process would (its own store object)
    assert store.lookup(first) == 32  # the recurrent state at 40 is gone: the hit ends at 32
    assert store.stats.vanished_entries == 2
    assert store.lookup(first) == 32 and store.stats.vanished_entries == 2  # counted once
    # A corrupt entry the store itself finds and deletes is counted as corrupt, not as vanished.
    damaged = store.entry_key(store.keys(second)[0], 0)
    value = bytearray(store.store.get(damaged) or b"")
    value[-3] ^= 0x10
    store.store.put(damaged, bytes(value))
    assert store.load(second, 40).num_tokens == 0
    assert store.stats.corrupt_entries == 1
    assert store.lookup(second) == 0
    assert store.stats.vanished_entries == 2
    stores = Registry()
    stores.add(store, store.stats)
    registry = CollectorRegistry()
    registry.register(Collector(stores))
    assert registry.get_sample_value("kvgroups_vanished_entries_total", {"tier": "file"}) == 2
    store.close()


def test_a_tier_out_of_reach_is_not_counted_as_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that could not ask a tier (backed off after a failure) misses its entries without saying they
    are gone; once the tier answers again they are found."""
    with running_server(tmp_path / "valkey") as server:
        store = KVChunkStore(build_metadata(MIXED_KINDS), [f"file://{tmp_path}/kv", server.url])
        tokens = prompts(1)[0]
        save_all(store, [tokens])
        store.store.tiers[0].clear()  # the file tier forgets them: only the server holds them now
        assert store.lookup(tokens) == 40
        server.stop()
        assert store.lookup(tokens) == 0  # the server fails: backed off
        assert store.lookup(tokens) == 0  # asked while it is backed off
        assert store.stats.vanished_entries == 0
    store.close()


def test_wait_replicas_counts_a_write_no_replica_acknowledged_as_a_failed_save_without_backing_off(
        tmp_path: Path) -> None:
    with running_server(tmp_path / "primary") as primary:
        url = primary.url + "?wait_replicas=1&wait_timeout=0.2"
        store = KVChunkStore(build_metadata(MIXED_KINDS), url)
        tokens = prompts(1)[0]
        begin = time.monotonic()
        save_all(store, [tokens])
        assert store.stats.failed_saves == 5 and store.stats.saved_chunks == 0  # no replica: none acknowledged
        assert time.monotonic() - begin >= 5 * 0.2
        assert store._backoff.available()  # the server answered: it is not left alone
        assert store.lookup(tokens) == 40  # on the primary all the same; only the promise was not kept
        replica = Server(tmp_path / "replica", settings=("--replicaof", "127.0.0.1", str(primary.port)))
        try:
            deadline = time.monotonic() + 30
            while replica_link(replica) != "up":
                assert time.monotonic() < deadline, "the replica did not sync within 30 s"
                time.sleep(0.1)
            # With a replica every write is acknowledged. WAIT gets 5 s here: the 0.2 s that keeps the refusals above
            # quick was too short for a replica on a loaded machine (a save failed in a make test run).
            acknowledging = KVChunkStore(build_metadata(MIXED_KINDS), primary.url + "?wait_replicas=1&wait_timeout=5"
                                         "&timeout=10")
            other = prompts(2)[1]
            save_all(acknowledging, [other])
            assert acknowledging.stats.saved_chunks == 5 and acknowledging.stats.failed_saves == 0
            on_replica = open_store(replica.url)
            keys = [acknowledging.entry_key(key, group) for key in acknowledging.keys(other) for group in range(3)]
            assert all(on_replica.contains_many(keys))  # acknowledged: the replica holds every entry
            acknowledging.close()
        finally:
            replica.stop()
        store.close()


def replica_link(server: Server) -> str:
    return str(redis.Redis.from_url(server.url).info("replication").get("master_link_status"))


@pytest.mark.parametrize(("query", "problem"), [
    ("wait_replicas=-1", "wait_replicas='-1' must be a whole number >= 0"),
    ("wait_replicas=one", "wait_replicas='one' must be a whole number >= 0"),
    ("wait_timeout=2", "wait_timeout='2' must be less than the connection's timeout \\(2 s\\)"),
    ("timeout=1&wait_timeout=0", "wait_timeout='0' must be a finite, positive number of seconds"),
])
def test_bad_wait_options_are_refused_naming_them(query: str, problem: str) -> None:
    with pytest.raises(KVGroupsError, match=problem):
        parse_redis_url(f"redis://127.0.0.1:7000/0?{query}")
    settings_ = parse_redis_url("redis-cluster://h:7000/?wait_replicas=2&timeout=3")
    assert (settings_.wait_replicas, settings_.wait_timeout_seconds) == (2, 1.5)
