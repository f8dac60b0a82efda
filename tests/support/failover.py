"""A Valkey/Redis Cluster's failover, timed: when the cluster says it is whole again, and when a chunk store
hits again (tests/store/test_cluster.py and benchmarks/store/failover.py)."""

from __future__ import annotations

import time
from typing import Any

from kvgroups.store import KVChunkStore


def cluster_ok(cluster: Any, victim: int) -> bool:
    """Every live node says ``cluster_state:ok`` and three masters are up, ``victim`` not among them (its replica
    took over)."""
    live = [port for port, node in cluster.nodes.items() if node.process.poll() is None]
    masters = cluster.masters()
    return len(masters) == 3 and victim not in masters and all(
        "cluster_state:ok" in cluster.ask(port, "cluster", "info") for port in live)


def failover_seconds(cluster: Any, store: KVChunkStore, every: list[list[int]], victim: int) -> tuple[float, float]:
    """Kill ``victim``; the seconds until the cluster says it is whole again, and until every prompt hits."""
    killed = time.monotonic()
    cluster.kill(victim)
    ok_at = hits_at = None
    while ok_at is None or hits_at is None:
        now = time.monotonic()
        assert now - killed < 90, f"after {now - killed:.1f} s: cluster ok {ok_at}, hits {hits_at}"
        if hits_at is None and [store.lookup(tokens) for tokens in every] == [40] * len(every):
            hits_at = time.monotonic()
        if ok_at is None and cluster_ok(cluster, victim):
            ok_at = time.monotonic()
        time.sleep(0.05)
    return ok_at - killed, hits_at - killed
