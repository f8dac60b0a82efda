"""How soon a chunk store on a Valkey/Redis Cluster serves again after a master fails over: repeated.

A 3-master, 3-replica cluster on loopback (the test suite's), a ``KVChunkStore`` built from a URL
naming two of its nodes, 12 prompts stored. Each repetition kills one master (the one the URL
names first, while it is a master; else the first master), times how long until every live node
says ``cluster_state:ok`` with a promoted replica, and until every prompt is found whole again,
then starts the killed node again (it rejoins as a replica) and waits for the cluster to be whole.
Once with the servers' defaults (``cluster-require-full-coverage yes``: the cluster refuses every
query until the failover is done), once with ``cluster-require-full-coverage no``; both with the
servers' default ``cluster-node-timeout`` (15 s) unless ``--node-timeout-ms`` says otherwise.
Prints a table per setting and exits 1 if any repetition served again later than ``--bound`` seconds
after the cluster said it was whole.

Run: ``.venv/bin/python benchmarks/failover.py [--repetitions 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.failover import failover_seconds
from tests.support.servers import Server, running_cluster
from tests.support.stored_chunks import MIXED_KINDS, build_metadata, prompts, save_all

from kvgroups.store import KVChunkStore


def repeat(directory: Path, coverage: str, node_timeout_ms: int, repetitions: int) -> list[tuple[float, float]]:
    """(seconds until the cluster is whole, seconds until every prompt hits) after each kill."""
    settings = ("--cluster-require-full-coverage", coverage, "--cluster-node-timeout", str(node_timeout_ms))
    results = []
    with running_cluster(directory, settings=settings) as cluster:
        store = KVChunkStore(build_metadata(MIXED_KINDS), cluster.url)
        every = prompts(12)
        save_all(store, every)
        for repetition in range(repetitions):
            masters = cluster.masters()
            for port in masters:
                cluster.in_sync(port)
            victim = cluster.ports[0] if cluster.ports[0] in masters else masters[0]
            ok_after, hits_after = failover_seconds(cluster, store, every, victim)
            results.append((ok_after, hits_after))
            print(f"{coverage}: repetition {repetition + 1}: whole after {ok_after:.2f} s, hits after "
                  f"{hits_after:.2f} s ({hits_after - ok_after:+.2f} s)", flush=True)
            old = cluster.nodes[victim]
            cluster.nodes[victim] = Server(old.directory, port=victim, settings=old.settings)  # rejoins as a replica
            cluster.wait_until_ok(3, 1, timeout=120)
        store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--node-timeout-ms", type=int, default=15000,
                        help="cluster-node-timeout (default: the servers')")
    parser.add_argument("--bound", type=float, default=2.0, help="seconds after the cluster is whole")
    args = parser.parse_args()
    late = 0
    tables = []
    for coverage in ("yes", "no"):
        with tempfile.TemporaryDirectory(prefix="kvgroups-failover-") as directory:
            results = repeat(Path(directory) / "cluster", coverage, args.node_timeout_ms, args.repetitions)
        after = [hits - ok for ok, hits in results]
        late += sum(value > args.bound for value in after)
        within = sum(value <= args.bound for value in after)
        tables.append(f"| {coverage} | {len(results)} | {statistics.median(ok for ok, _ in results):.1f} | "
                      f"{statistics.median(after):.2f} | {max(after):.2f} | {within} |")
    print(f"\nA master killed, {args.repetitions} times per setting; cluster-node-timeout {args.node_timeout_ms} ms; "
          f"the store built from a URL naming two of the six nodes, its back-off as it ships\n")
    print("| cluster-require-full-coverage | kills | whole again after (median s) | hits after whole (median s) | "
          f"worst s | within {args.bound:.0f} s |")
    print("|---|---|---|---|---|---|")
    for row in tables:
        print(row)
    sys.exit(1 if late else 0)


if __name__ == "__main__":
    main()
