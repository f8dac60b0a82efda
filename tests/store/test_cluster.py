"""A Valkey/Redis Cluster as the multi-node store, on a real cluster started here (3 masters, 3 replicas).

A master killed mid-run costs the misses of its slots, never an exception, and once its replica
is promoted the store serves them again without a restart; two processes with their own store
objects and connections share prefixes through the cluster. (The contract every tier keeps runs on
a cluster too: tests/store/test_contract.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
import torch

from kvgroups.cli import main
from kvgroups.core.sizes import MIB
from kvgroups.store import KVChunkStore, open_store
from kvgroups.store.backends.redis import value_parts
from kvgroups.store.backends.redis.cluster import RedisClusterStore
from tests.support.failover import cluster_ok as failover_ok
from tests.support.failover import failover_seconds
from tests.support.paths import ROOT
from tests.support.servers import running_cluster
from tests.support.stored_chunks import MIXED_KINDS, build_metadata, chunk_tensors, prompts, save_all


def assert_exact(store: KVChunkStore, tokens: list[int], loaded_tokens: int) -> None:
    loaded = store.load(tokens, loaded_tokens)
    assert loaded.num_tokens == loaded_tokens
    for part in loaded.groups:
        if store.groups[part.group_index].token_indexed:
            first, last = part.first_token // 8, loaded_tokens // 8
            expected = torch.cat([chunk_tensors(store, tokens, chunk)[part.group_index]
                                  for chunk in range(first, last)], dim=2)
        else:
            expected = chunk_tensors(store, tokens, loaded_tokens // 8 - 1)[part.group_index]
        assert torch.equal(part.tensor, expected)


def test_a_master_that_dies_costs_misses_then_hits_again_after_failover(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgroups.store.backends import health

    monkeypatch.setattr(health, "RETRY_AFTER_SECONDS", 0.5)
    with running_cluster(tmp_path / "cluster") as cluster:
        store = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
        assert isinstance(store.store, RedisClusterStore)
        every = prompts(12)
        save_all(store, every)
        assert [store.lookup(tokens) for tokens in every] == [40] * 12
        assert all(count > 0 for count in store.store.stats_by_master().values())  # spread over every master
        for port in cluster.masters():  # replicated before the kill (replication is asynchronous)
            cluster.in_sync(port)
        victim = cluster.masters()[0]
        cluster.kill(victim)
        served = [store.lookup(tokens) for tokens in every]  # never an exception: misses of its slots
        for tokens, boundary in zip(every, served, strict=True):
            assert store.verify(tokens, boundary) <= boundary
            assert store.load(tokens, boundary).num_tokens <= boundary
        assert min(served) < 40
        cluster.wait_for_masters(3)  # a replica took over the dead master's slots
        deadline = time.monotonic() + 30
        while [store.lookup(tokens) for tokens in every] != [40] * 12:
            assert time.monotonic() < deadline, "the store did not serve the promoted replica's slots"
            time.sleep(0.5)
        for tokens in every:
            assert_exact(store, tokens, 40)
        store.close()


WRITER = """
    import sys
    from kvgroups.store import KVChunkStore
    from tests.support.stored_chunks import MIXED_KINDS, build_metadata, prompts, save_all
    store = KVChunkStore(build_metadata(MIXED_KINDS), sys.argv[1])
    save_all(store, prompts(int(sys.argv[2]))[int(sys.argv[3]):])
    store.close()
"""


def test_two_processes_share_prefixes_through_the_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_cluster(tmp_path / "cluster") as cluster:
        # Another "node": its own process, store object and connections, writing prompts 2-5.
        subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), cluster.url, "6", "2"], cwd=ROOT, check=True,
                       timeout=120)
        here = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
        save_all(here, prompts(2))  # and this one writes prompts 0-1
        for tokens in prompts(6):
            assert here.lookup(tokens) == 40
            assert_exact(here, tokens, 40)
        reader = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import json, sys
            from kvgroups.store import KVChunkStore
            from tests.support.stored_chunks import MIXED_KINDS, build_metadata, prompts
            store = KVChunkStore(build_metadata(MIXED_KINDS), sys.argv[1])
            print(json.dumps([store.lookup(tokens) for tokens in prompts(2)]))
        """), cluster.url], cwd=ROOT, check=True, timeout=120, capture_output=True, text=True)
        assert json.loads(reader.stdout) == [40, 40]
        # The CLI sees every master's entries.
        assert main(["store", "stats", cluster.url, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["entries"] == 6 * 5 * 3  # six prompts of five chunks, three groups each
        assert main(["store", "verify", cluster.url]) == 0
        assert "0 bad" in capsys.readouterr().out
        here.close()


def test_each_master_evicts_its_own_least_recently_used(tmp_path: Path) -> None:
    """Under allkeys-lru a master evicts its own least recently used values: keys that hash to one
    master, the first used after the others were written, then filled until the master evicts."""
    value = 256 * 1024 - 64
    settings = ("--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "64")
    # No replicas: a replication backlog allocated after the budget is set would take part of it.
    with running_cluster(tmp_path / "cluster", replicas=0, settings=settings) as cluster:
        store = open_store(cluster.url)
        assert isinstance(store, RedisClusterStore)
        master = store._client.get_node_from_key(value_parts.head_name("k0")).name
        same = [name for name in (f"k{index}" for index in range(400))
                if store._client.get_node_from_key(value_parts.head_name(name)).name == master]
        port = int(master.rsplit(":", 1)[1])
        client = redis.Redis(port=port)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 2 * MIB)
        for name in same[:4]:
            store.put(name, bytes(value))
        time.sleep(1.1)  # a server's LRU clock ticks once a second
        assert store.get(same[0]) is not None
        time.sleep(1.1)
        # Filled until the master evicts (asked of INFO: EXISTS would touch the keys it asks about).
        filled = 4
        while int(client.info("stats")["evicted_keys"]) == 0:
            assert filled < 24, "nothing was evicted"
            store.put(same[filled], bytes(value))
            filled += 1
        assert store.get(same[0]) is not None  # used after the others: still there
        assert sum(store.contains(name) for name in same[1:4]) < 3  # one of the least recently used went
        client.close()
        store.close()


def test_cluster_urls_are_checked(tmp_path: Path) -> None:
    from kvgroups.errors import KVGroupsError

    with pytest.raises(KVGroupsError, match=r"'h1' is not host:port"):
        open_store("redis-cluster://h1,h2:7001/")
    with pytest.raises(KVGroupsError, match=r"a cluster has one database"):
        open_store("redis-cluster://h1:7000/3")
    with pytest.raises(KVGroupsError, match=r"ttl='0.5' must be a positive number of whole seconds"):
        open_store("redis-cluster://h1:7000/?ttl=0.5")


@pytest.mark.parametrize("coverage", ["no", "yes"], ids=["full-coverage-no", "full-coverage-yes (the default)"])
def test_hits_come_back_within_2_s_of_the_cluster_saying_it_is_whole_again(tmp_path: Path, coverage: str) -> None:
    """A master killed, its replica promoted: the store serves its slots again at most 2 s after every live
    node says ``cluster_state:ok``, with the store's own back-off as it ships (5 s), the store built from a
    URL naming two of the six nodes, and the servers refusing every query meanwhile or not."""
    with running_cluster(tmp_path / "cluster", settings=("--cluster-require-full-coverage", coverage)) as cluster:
        store = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
        every = prompts(12)
        save_all(store, every)
        for port in cluster.masters():
            cluster.in_sync(port)
        # The first master the URL names: the store's own entry point into the cluster goes with it.
        ok_after, hits_after = failover_seconds(cluster, store, every, cluster.ports[0] if cluster.ports[0] in
                                                cluster.masters() else cluster.masters()[0])
        assert hits_after - ok_after <= 2.0, (ok_after, hits_after)
        for tokens in every:
            assert_exact(store, tokens, 40)
        store.close()


def _entry_keys(store: KVChunkStore, every: list[list[int]]) -> list[str]:
    return [store.entry_key(key, group) for tokens in every for key in store.keys(tokens)
            for group in range(len(store.groups))]


def _saved_acknowledged(store: KVChunkStore, every: list[list[int]]) -> set[str]:
    """Save every chunk of ``every``; the entry keys the store said were written."""
    acknowledged: set[str] = set()
    for tokens in every:
        keys = store.keys(tokens)
        for chunk, key in enumerate(keys):
            store.save_chunk(key, chunk, dict(enumerate(chunk_tensors(store, tokens, chunk))),
                             written=acknowledged.update)
    assert store.flush(timeout=60)
    return acknowledged


def test_ten_failovers_serve_again_within_2_s_or_count_the_loss_and_wait_replicas_loses_nothing_acknowledged(
        tmp_path: Path) -> None:
    """A master killed ten times (the servers' default: every query refused until the failover is done), each
    time the master whose replica was the node started again last: it has not copied its master yet (the
    servers' 5 s diskless-sync delay), so what was saved to that master just before dies with it. Two stores
    on the cluster save fresh prompts before each kill: without ``wait_replicas`` every prompt hits again within
    2 s of the cluster being whole, or the entries that did not survive are counted, each once
    (``vanished_entries``), and only after the cluster is whole (a master out of reach is not a loss); with
    ``wait_replicas=1`` every chunk the store acknowledged is there within 2 s, and what no replica took in
    time is a failed save, not an acknowledged one."""
    with running_cluster(tmp_path / "cluster", settings=("--cluster-require-full-coverage", "yes")) as cluster:
        plain = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
        waiting = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url + "?wait_replicas=1&wait_timeout=0.2")
        restarted: int | None = None
        losses, acknowledged_total = 0, 0
        for repetition in range(10):
            every = [[tokens + 100_000 * repetition for tokens in prompt] for prompt in prompts(3)]
            mine = [[tokens + 50_000 for tokens in prompt] for prompt in every]
            acknowledged = _saved_acknowledged(waiting, mine)
            save_all(plain, every)
            acknowledged_total += len(acknowledged)
            vanished_before = plain.stats.vanished_entries
            victim = cluster.master_of(restarted) if restarted is not None else cluster.masters()[0]
            killed = time.monotonic()
            cluster.kill(victim)
            ok_at = None
            while ok_at is None:
                assert time.monotonic() - killed < 60, "no failover within 60 s"
                [plain.lookup(tokens) for tokens in every]  # misses meanwhile: out of reach, not lost
                assert plain.stats.vanished_entries == vanished_before
                if failover_ok(cluster, victim):
                    ok_at = time.monotonic()
            while [plain.lookup(tokens) for tokens in every] != [40] * len(every) and time.monotonic() < ok_at + 2:
                time.sleep(0.05)
            hits = [plain.lookup(tokens) for tokens in every]
            missing = _entry_keys(plain, every)
            missing = [key for key, there in zip(missing, plain.store.contains_many(missing), strict=True) if not there]
            assert (hits == [40] * len(every)) == (not missing), (hits, len(missing))
            assert plain.stats.vanished_entries - vanished_before == len(missing), repetition
            losses += bool(missing)
            there = waiting.store.contains_many(sorted(acknowledged))
            deadline = ok_at + 2
            while not all(there) and time.monotonic() < deadline:
                time.sleep(0.05)
                there = waiting.store.contains_many(sorted(acknowledged))
            assert all(there), f"repetition {repetition}: {there.count(False)} acknowledged entries lost"
            cluster.restart(victim)
            restarted = victim
        print(f"without wait_replicas: entries lost in {losses} of 10 failovers; with it: {acknowledged_total} "
              f"entries acknowledged, none lost, {waiting.stats.failed_saves} chunk saves not acknowledged in time")
        assert acknowledged_total and waiting.stats.failed_saves  # both sides of the option were exercised
        plain.close()
        waiting.close()
