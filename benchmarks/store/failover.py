"""How soon a chunk store on a Valkey/Redis Cluster serves again after a master fails over, and what a failover
loses, with and without ``wait_replicas``: repeated.

A 3-master, 3-replica cluster on loopback (the test suite's), the servers' default
``cluster-require-full-coverage yes`` (the cluster refuses every query until the failover is done), two
``KVChunkStore`` objects on it built from a URL naming two of its nodes: one as it ships, one with
``?wait_replicas=1`` (a chunk counts as saved only once a replica acknowledged it). Each repetition kills a
master, times how long until every live node says ``cluster_state:ok`` with a promoted replica ("whole"),
and until the store finds every prompt it should, then starts the killed node again (it rejoins as a
replica) and waits for the cluster to be whole. Two protocols, ``--repetitions`` times each:

- synced: 12 prompts saved once, and before each kill every master's replica has copied it (``WAIT 1``
  answers 1): the time from whole to full hits (median, worst), which should lose nothing; asked once
  the cluster is whole, and again with a reader asking throughout (from the kill on: the dead master's
  back-off is fresh when the failover completes);
- unsynced: the master killed is the one whose replica was just started again (it copies its master only
  after the servers' 5 s diskless-sync delay), right after both stores saved 3 fresh prompts: the entries
  lost without the option (counted by the store as ``vanished_entries``) and, with it, the acknowledged
  entries lost (none may be) and the saves no replica acknowledged in time.

Then the option's cost: seconds per chunk saved, with and without it, on the whole cluster (interleaved).
Prints the tables and exits 1 if a synced repetition served again later than ``--bound`` seconds after the
cluster said it was whole, or an acknowledged entry was lost.

Run: ``.venv/bin/python -m benchmarks.store.failover [--repetitions 20] [--node-timeout-ms 1000]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvgroups.store import KVChunkStore
from tests.support.failover import cluster_ok, failover_seconds
from tests.support.servers import Cluster, running_cluster
from tests.support.stored_chunks import MIXED_KINDS, build_metadata, chunk_tensors, prompts, save_all

WAIT = "?wait_replicas=1&wait_timeout=0.2"


def fresh(repetition: int, offset: int) -> list[list[int]]:
    return [[token + 100_000 * (repetition + 1) + offset for token in prompt] for prompt in prompts(3)]


def save_acknowledged(store: KVChunkStore, every: list[list[int]]) -> set[str]:
    """Save every chunk of ``every``; the entry keys the store said were written."""
    acknowledged: set[str] = set()
    for tokens in every:
        for chunk, key in enumerate(store.keys(tokens)):
            store.save_chunk(key, chunk, dict(enumerate(chunk_tensors(store, tokens, chunk))),
                             written=acknowledged.update)
    store.flush(timeout=120)
    return acknowledged


def kill_and_wait(cluster: Cluster, victim: int) -> float:
    """Kill ``victim``; the monotonic time the cluster said it was whole again."""
    killed = time.monotonic()
    cluster.kill(victim)
    while not cluster_ok(cluster, victim):
        if time.monotonic() - killed > 120:
            raise RuntimeError("no failover within 120 s")
        time.sleep(0.05)
    return time.monotonic()


def synced(cluster: Cluster, repetitions: int, *, throughout: bool = False) -> list[float]:
    """Seconds from the cluster whole again to every prompt hitting, per kill, the replicas in sync first; asked
    once the cluster is whole, or (``throughout``) by a reader asking from the kill on, so that the dead
    master's back-off is fresh when the failover completes."""
    store = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
    every = prompts(12)
    save_all(store, every)
    after = []
    for repetition in range(repetitions):
        for port in cluster.masters():
            cluster.in_sync(port)
        masters = cluster.masters()
        victim = cluster.ports[0] if cluster.ports[0] in masters else masters[0]  # the URL's first node, first
        if throughout:
            whole_after, hits_after = failover_seconds(cluster, store, every, victim)
            after.append(max(0.0, hits_after - whole_after))
        else:
            whole = kill_and_wait(cluster, victim)
            while [store.lookup(tokens) for tokens in every] != [40] * len(every):
                if time.monotonic() - whole > 30:
                    raise RuntimeError(f"synced repetition {repetition + 1}: no full hits within 30 s of whole")
                time.sleep(0.02)
            after.append(time.monotonic() - whole)
        print(f"synced{' (asking throughout)' if throughout else ''} {repetition + 1}: hits {after[-1]:.2f} s after "
              f"whole", flush=True)
        cluster.restart(victim)
    store.close()
    return after


def unsynced(cluster: Cluster, repetitions: int) -> dict[str, int]:
    """Entries lost per kill right after a replica started again, without and with ``wait_replicas``."""
    plain = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
    waiting = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url + WAIT)
    counts = dict.fromkeys(("saved", "lost", "losing_kills", "acknowledged", "acknowledged_lost"), 0)
    restarted = None
    for repetition in range(repetitions):
        acknowledged = save_acknowledged(waiting, fresh(repetition, 50_000))
        every = fresh(repetition, 0)
        save_all(plain, every)
        keys = [plain.entry_key(key, group) for tokens in every for key in plain.keys(tokens) for group in range(3)]
        victim = cluster.master_of(restarted) if restarted is not None else cluster.masters()[0]
        vanished = plain.stats.vanished_entries
        whole = kill_and_wait(cluster, victim)
        while time.monotonic() < whole + 2 and [plain.lookup(tokens) for tokens in every] != [40] * len(every):
            time.sleep(0.05)
        [plain.lookup(tokens) for tokens in every]
        lost = plain.stats.vanished_entries - vanished
        missing = sum(not there for there in plain.store.contains_many(keys))
        if lost != missing:
            raise RuntimeError(f"unsynced repetition {repetition + 1}: {missing} entries missing, {lost} counted")
        acknowledged_lost = sum(not there for there in waiting.store.contains_many(sorted(acknowledged)))
        counts["saved"] += len(keys)
        counts["lost"] += lost
        counts["losing_kills"] += bool(lost)
        counts["acknowledged"] += len(acknowledged)
        counts["acknowledged_lost"] += acknowledged_lost
        print(f"unsynced {repetition + 1}: without wait_replicas {lost} of {len(keys)} entries lost; with it "
              f"{acknowledged_lost} of {len(acknowledged)} acknowledged entries lost", flush=True)
        cluster.restart(victim)
        restarted = victim
    counts["unacknowledged_saves"] = waiting.stats.failed_saves
    counts["wait_saves"] = waiting.stats.failed_saves + waiting.stats.saved_chunks
    plain.close()
    waiting.close()
    return counts


def save_cost(cluster: Cluster, rounds: int = 15) -> tuple[float, float]:
    """Median seconds per chunk saved (all groups' entries), without and with ``wait_replicas``, interleaved."""
    for port in cluster.masters():
        cluster.in_sync(port)
    stores = [KVChunkStore(build_metadata(MIXED_KINDS), cluster.url + query) for query in ("", WAIT)]
    seconds: list[list[float]] = [[], []]
    for number in range(rounds):
        for index, store in enumerate(stores):
            every = [[token + 10_000_000 * (index + 1) + 100_000 * number for token in prompt] for prompt in prompts(4)]
            begin = time.perf_counter()
            save_all(store, every)
            seconds[index].append((time.perf_counter() - begin) / (4 * 5))
    for store in stores:
        store.close()
    return statistics.median(seconds[0]), statistics.median(seconds[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--node-timeout-ms", type=int, default=1000,
                        help="cluster-node-timeout (the test suite's 1000 by default; the servers' own is 15000)")
    parser.add_argument("--bound", type=float, default=2.0, help="seconds after the cluster is whole")
    args = parser.parse_args()
    settings = ("--cluster-require-full-coverage", "yes", "--cluster-node-timeout", str(args.node_timeout_ms))
    with tempfile.TemporaryDirectory(prefix="kvgroups-failover-") as directory:
        with running_cluster(Path(directory) / "synced", settings=settings) as cluster:
            after = synced(cluster, args.repetitions)
            throughout = synced(cluster, args.repetitions, throughout=True)
        with running_cluster(Path(directory) / "unsynced", settings=settings) as cluster:
            counts = unsynced(cluster, args.repetitions)
            plain_seconds, wait_seconds = save_cost(cluster)
    late = sum(value > args.bound for value in after) + sum(value > args.bound for value in throughout)
    print(f"\nA master killed {args.repetitions} times per protocol; cluster-node-timeout {args.node_timeout_ms} ms, "
          f"cluster-require-full-coverage yes; the stores built from a URL naming two of the six nodes\n")
    print(f"| replicas in sync before the kill | kills | hits after whole (median s) | worst s | within "
          f"{args.bound:.0f} s |")
    print("|---|---|---|---|---|")
    for how, values in (("yes", after), ("yes, a reader asking throughout", throughout)):
        within = sum(value <= args.bound for value in values)
        print(f"| {how} | {len(values)} | {statistics.median(values):.2f} | {max(values):.2f} | {within} |")
    print("\n| the kill right after the replica restarted | entries saved | entries lost (counted) | kills losing "
          "some | acknowledged entries | acknowledged lost | chunk saves not acknowledged |")
    print("|---|---|---|---|---|---|---|")
    print(f"| without wait_replicas | {counts['saved']} | {counts['lost']} | {counts['losing_kills']} of "
          f"{args.repetitions} | {counts['saved']} | {counts['lost']} | 0 |")
    print(f"| wait_replicas=1, wait_timeout=0.2 | {counts['saved']} | - | - | {counts['acknowledged']} | "
          f"{counts['acknowledged_lost']} | {counts['unacknowledged_saves']} of {counts['wait_saves']} |")
    print(f"\nA chunk saved (3 entries), the cluster whole and in sync: {1000 * plain_seconds:.2f} ms without "
          f"wait_replicas, {1000 * wait_seconds:.2f} ms with it ({wait_seconds / plain_seconds:.2f}x)")
    sys.exit(1 if late or counts["acknowledged_lost"] else 0)


if __name__ == "__main__":
    main()
