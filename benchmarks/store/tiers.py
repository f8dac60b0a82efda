"""Byte-store tiers against the raw medium they sit on, 1 MiB and 32 MiB entries, in one run.

Per tier, put and get of the same bytes through the kvgroups store and through the raw baseline:
  memory  -- MemoryStore (thread-safe, LRU by byte budget) vs a plain dict;
  file    -- FileStore (temporary file + rename, key header, LRU budget) vs open().write / read();
  redis   -- RedisStore (key prefix, size check, TTL) vs the same redis-py client's SET / GET, on a
             real server started here (valkey-server or redis-server on a free port).
  sealed  -- the file tier with the codec: save (encode + put) and load (get + decode) of a chunk
             entry with a secret (MAC) and with encryption, against the same without a secret
             (its "raw" columns: an xxh3 checksum instead).
Values are handed over as a memoryview of a reused buffer, as the data path produces them, so
every tier and every baseline must copy them to keep them; like stored chunks (keyed by content)
each is written once, under a new key, and the gets read them back. Ours and the baseline alternate (A, B,
A, B, ...); the ratio is the median over the pairs of baseline time / our time (1.00 = as fast as
the raw medium). GiB/s and p50/p99 are per entry (memory reads, which take well under a
microsecond, are timed 64 at a time and divided).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from benchmarks.support.servers import installed_server, local_redis, running_cluster, running_server
from benchmarks.support.unmeasured import Unmeasured
from kvgroups.core.sizes import MIB
from kvgroups.store import FileStore, MemoryStore, open_store

Action = Callable[[int], object]
UNMEASURED = Unmeasured()  # what this run could not measure (a row each; the run then exits 1)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def interleaved(ours: Action, raw: Action, iterations: int) -> tuple[list[float], list[float]]:
    ours(0)
    raw(0)
    times: tuple[list[float], list[float]] = ([], [])
    for iteration in range(1, iterations + 1):
        for action, into in ((ours, times[0]), (raw, times[1])):
            begin = time.perf_counter()
            action(iteration)
            into.append(time.perf_counter() - begin)
    return times


def row(tier: str, size: int, op: str, times: tuple[list[float], list[float]]) -> str:
    ours, raw = times
    ratio = statistics.median(r / o for o, r in zip(ours, raw, strict=True))
    gib = size / (1 << 30)
    return (f"| {tier} | {size // MIB} MiB | {op} | {gib / statistics.median(ours):.2f} | "
            f"{statistics.median(ours) * 1e3:.3f} / {percentile(ours, 0.99) * 1e3:.3f} | "
            f"{gib / statistics.median(raw):.2f} | {statistics.median(raw) * 1e3:.3f} / "
            f"{percentile(raw, 0.99) * 1e3:.3f} | {ratio:.2f} |")


def measure(tier: str, put: Callable[[str, memoryview], object], get: Callable[[str], object],
            raw_put: Callable[[str, memoryview], object], raw_get: Callable[[str], object], size: int,
            iterations: int, keys: int, get_batch: int = 1) -> list[str]:
    buffer = bytearray(size)
    value = memoryview(buffer)

    def fill(iteration: int) -> memoryview:
        buffer[:8] = iteration.to_bytes(8, "little")  # a different value every time
        return value

    # Entries are content-addressed, written once: every put writes a new key. Gets read those back.
    rows = [row(tier, size, "put", interleaved(lambda i: put(f"k{i}", fill(i)), lambda i: raw_put(f"k{i}", fill(i)),
                                               iterations))]
    names = [f"k{index}" for index in range(keys)]

    def gets(read: Callable[[str], object]) -> Action:
        # Sub-microsecond reads are timed get_batch at a time, so that the clock's own cost does not dominate.
        return lambda i: [read(names[(i + step) % keys]) for step in range(get_batch)]

    ours, raw = interleaved(gets(get), gets(raw_get), iterations)
    rows.append(row(tier, size, "get", ([t / get_batch for t in ours], [t / get_batch for t in raw])))
    return rows


def memory_rows(size: int, iterations: int) -> list[str]:
    store = MemoryStore(max_bytes=(iterations + 2) * size)
    plain: dict[str, bytes] = {}

    def raw_put(key: str, value: memoryview) -> None:
        plain[key] = bytes(value)

    return measure("memory", store.put, store.get, raw_put, plain.get, size, iterations, keys=16,  # type: ignore[arg-type]
                   get_batch=64)


def file_rows(directory: Path, size: int, iterations: int) -> list[str]:
    store = FileStore(directory / "store", max_bytes=(iterations + 2) * size)
    raw_directory = directory / "raw"
    raw_directory.mkdir()

    def raw_put(key: str, value: memoryview) -> None:
        with open(raw_directory / key, "wb") as file:
            file.write(value)

    def raw_get(key: str) -> bytes:
        with open(raw_directory / key, "rb") as file:
            return file.read()

    return measure("file", store.put, store.get, raw_put, raw_get, size, iterations, keys=16)  # type: ignore[arg-type]


def redis_rows(directory: Path, size: int, iterations: int) -> list[str]:
    with local_redis(directory) as url:
        if url is None:
            return [UNMEASURED.row(f"redis, {size // MIB} MiB", "no valkey-server or redis-server installed",
                                   columns=8)]
        store = open_store(url)
        client = store._client  # type: ignore[attr-defined]  # the same client, without kvgroups around it
        return measure("redis", store.put, store.get, client.set, client.get, size, iterations, keys=16)  # type: ignore[arg-type]


def sealed_rows(directory: Path, size: int, iterations: int) -> list[str]:
    """``KVChunkStore`` on the file tier with a secret (a MAC on every entry) and with encryption,
    each paired with the same store without a secret (an xxh3 checksum) as the baseline: a save of
    one chunk (encode and write, flushed) and a load of an 8-chunk prefix (read, check, decode and
    put together), per chunk."""
    import torch

    from kvgroups import KVLayerGroupsManager, LMCacheMetadata
    from kvgroups.store import KVChunkStore

    chunk_tokens, prefix_chunks = 256, 8
    heads = size // (2 * chunk_tokens * 128 * 2)  # one layer of bfloat16 K/V: `size` bytes per chunk
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({"layer": torch.empty(2, 64, 16, heads, 128, dtype=torch.bfloat16, device="meta")})
    metadata = LMCacheMetadata.for_groups(manager.kv_layer_groups, model_name="bench", chunk_size=chunk_tokens)
    chunk = torch.randn(2, 1, chunk_tokens, heads * 128).to(torch.bfloat16)
    secret = "benchmark secret, 32 bytes long.."
    prompt = list(range(prefix_chunks * chunk_tokens))

    def save(store: KVChunkStore, iteration: int) -> None:
        store.save([iteration] * chunk_tokens, 0, [chunk])
        store.flush()

    def load(store: KVChunkStore) -> None:
        assert store.load(prompt, len(prompt)).num_tokens == len(prompt)

    def pair(label: str, sealed: dict[str, object]) -> list[str]:
        ours, raw = (KVChunkStore(metadata, FileStore(directory / f"{label[7:10]}{kind}", max_bytes=64 << 30),
                                  **options)  # type: ignore[arg-type]
                     for kind, options in (("s", sealed), ("p", {})))
        for store in (ours, raw):
            for index in range(prefix_chunks):
                store.save(prompt, index, [chunk])
            store.flush()
        saves = interleaved(lambda i: save(ours, i), lambda i: save(raw, i), iterations)
        loads = interleaved(lambda i: load(ours), lambda i: load(raw), max(4, iterations // prefix_chunks))
        ours.close()
        raw.close()
        per_chunk = ([t / prefix_chunks for t in loads[0]], [t / prefix_chunks for t in loads[1]])
        return [row(label, size, "save", saves), row(label, size, "load", per_chunk)]

    return pair("file + MAC", {"secret": secret}) + pair("file + encryption", {"secret": secret, "encrypt": True})


# Values each side moves per measurement (1 MiB each for redis-benchmark): long enough that a 2-core
# machine's scheduling noise averages out.
ANCHOR_REQUESTS = 256


def anchor_gibs(port: int, op: str, size: int, requests: int) -> float:
    """What the server's own C client moves with one connection: ``redis-benchmark -c 1``, GiB/s."""
    output = subprocess.run(["redis-benchmark", "-p", str(port), "-t", op, "-c", "1", "-d", str(size), "-n",
                             str(requests), "-q"], capture_output=True, text=True, check=True).stdout
    (rate,) = re.findall(r"([\d.]+) requests per second", output.replace("\r", "\n"))[-1:]
    return float(rate) * size / (1 << 30)


def owner_of_benchmark_key(cluster: Any) -> int:
    """The port of the cluster master holding ``key:__rand_int__``, the one key redis-benchmark sets and
    gets (it names no other without -r)."""
    client = redis.Redis(port=cluster.ports[0])
    slot = int(client.execute_command("CLUSTER", "KEYSLOT", "key:__rand_int__"))
    for start, end, (_, port, *_) in ([int(part) for part in shard[:2]] + [shard[2]]
                                      for shard in client.execute_command("CLUSTER", "SLOTS")):
        if start <= slot <= end:
            client.close()
            return int(port)
    raise RuntimeError("no master holds the benchmark key's slot")


def server_rows(root: Path, rounds: int) -> list[str]:
    """The Redis tier, on one server and on a 3-master cluster (each master with a replica), against
    ``redis-benchmark -c 1`` with 1 MiB values on the same deployment (for the cluster: on the master
    holding its key, which replicates what it is sent as ours do), run in turn, round after round;
    ratios are medians over the rounds of ours / the anchor's rate in the same round."""
    if shutil.which("redis-benchmark") is None or installed_server() is None:
        return [UNMEASURED.row("the Redis tier against redis-benchmark", "no redis-benchmark or server installed",
                               columns=5)]
    rows: dict[tuple[str, str, int], list[float]] = {}
    rates: dict[tuple[str, str, int], list[float]] = {}
    with running_server(root / "server") as server, running_cluster(root / "cluster") as cluster:
        stores = {"redis": (open_store(server.url), server.port),
                  "redis-cluster": (open_store(cluster.url), owner_of_benchmark_key(cluster))}
        for _ in range(rounds):
            for name, (store, anchor_port) in stores.items():
                # SET first: redis-benchmark's GET then reads the value it wrote (never a missing key).
                anchors = {op: anchor_gibs(anchor_port, op, MIB, ANCHOR_REQUESTS) for op in ("set", "get")}
                for op, rate in anchors.items():
                    rates.setdefault((f"redis-benchmark -c 1 ({name})", op.upper(), MIB), []).append(rate)
                for size in (MIB, 16 * MIB):
                    # Eight keys replaced in turn: the server's own client replaces one key, so neither
                    # pays for the server allocating new memory on every write.
                    count = max(8, ANCHOR_REQUESTS * MIB // size)
                    value = memoryview(bytearray(size))
                    begin = time.perf_counter()
                    for index in range(count):
                        store.put(f"b{size}-{index % 8}", value)
                    put = size * count / (time.perf_counter() - begin) / (1 << 30)
                    begin = time.perf_counter()
                    for index in range(count):
                        store.get(f"b{size}-{index % 8}", max_bytes=size)
                    get = size * count / (time.perf_counter() - begin) / (1 << 30)
                    for op, rate, anchor in (("get", get, anchors["get"]), ("put", put, anchors["set"])):
                        rows.setdefault((name, op, size), []).append(rate / anchor)
                        rates.setdefault((name, op, size), []).append(rate)
        for store, _ in stores.values():
            store.clear()
            store.close()
    lines = [f"| {client} | 1 MiB | {op} | {statistics.median(values):.2f} | 1.00 |"
             for (client, op, _), values in rates.items() if client.startswith("redis-benchmark")]
    lines += [f"| {name} | {size // MIB} MiB | {op} | {statistics.median(rates[name, op, size]):.2f} | "
              f"{statistics.median(ratios):.2f} |" for (name, op, size), ratios in rows.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=120, help="pairs per row (32 MiB rows use a quarter)")
    parser.add_argument("--tiers", default="memory,file,redis,sealed")
    parser.add_argument("--server-rounds", type=int, default=21, help="rounds of the Redis-against-its-client table")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; entries handed over as memoryviews of a reused buffer\n")
    print("| tier | entry | op | ours GiB/s | ours p50 / p99 ms | raw GiB/s | raw p50 / p99 ms | vs raw |")
    print("|---|---|---|---|---|---|---|---|")
    tiers = args.tiers.split(",")
    with tempfile.TemporaryDirectory() as root:
        for size in (MIB, 32 * MIB):
            iterations = args.iterations if size == MIB else max(8, args.iterations // 4)
            for tier in tiers:
                directory = Path(tempfile.mkdtemp(dir=root))
                if tier == "memory":
                    rows = memory_rows(size, iterations)
                elif tier == "file":
                    rows = file_rows(directory, size, iterations)
                elif tier == "sealed":
                    rows = sealed_rows(directory, size, iterations)
                else:
                    rows = redis_rows(directory, size, iterations)
                for line in rows:
                    print(line, flush=True)
        if args.server_rounds:
            print("\nThe Redis tier (one server; a cluster of 3 masters and 3 replicas) against the server's own C "
                  "client on the same deployment, one connection each:\n")
            print("| client | entry | op | GiB/s | vs redis-benchmark's 1 MiB rate of the same op on that deployment |")
            print("|---|---|---|---|---|")
            for line in server_rows(Path(tempfile.mkdtemp(dir=root)), args.server_rounds):
                print(line, flush=True)
    UNMEASURED.exit()


if __name__ == "__main__":
    main()
