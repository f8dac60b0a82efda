"""The Redis tier's batch reads against the server's own C client, pipelined, on one server.

A batch of B values of one size (16 x 1 MiB, 64 x 64 KiB) written once, then read back with
``get_many`` (with ``max_bytes`` the value's size, as the chunk store asks) again and again, against
``redis-benchmark -t get -P 16 -d SIZE`` with one connection and with four, on the same server (its
SET first: its GET then reads a value it wrote). Each client moves about the same number of values per
measurement, in turn (ours, theirs, ours, theirs ...); the ratio is the median over the rounds of our
values per second / redis-benchmark's requests per second in the same round.

``--compare SRC`` also times the kvgroups of another source tree (a checkout of the base commit:
``--compare /work/base/src``) in the same rounds. Every kvgroups variant reads in a worker process of
its own (``--worker``), started once, so that each is timed alike. A batch's buffers are new memory
(``get_many`` hands them to the caller): where glibc gives the top of its heap back to the kernel after
every batch, faulting them in again costs about as much as reading them on a VM. ``--keep-heap`` runs
the workers with glibc told to keep it (``MALLOC_TRIM_THRESHOLD_``), timing the reads alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.support.servers import installed_server, running_server
from benchmarks.support.unmeasured import Unmeasured
from kvgroups.core.sizes import KIB, MIB
from kvgroups.store import open_store  # a worker's: from the source tree its PYTHONPATH names

UNMEASURED = Unmeasured()
# (values a batch, bytes a value): the shapes measured.
SHAPES = ((16, MIB), (64, 64 * KIB))
# Bytes each client moves per measurement: long enough that a 2-core machine's scheduling noise averages out.
BYTES_PER_MEASUREMENT = 256 * MIB
PIPELINE = 16


def worker(url: str, batch: int, size: int) -> None:
    """Write ``batch`` values of ``size`` bytes, then on each line of stdin (a number of batches) read them
    that many times and answer the values read per second."""
    store = open_store(url)
    prefix = f"w{os.getpid()}-"
    value = bytes(range(256)) * (size // 256)
    store.put_many([(f"{prefix}{index}", value) for index in range(batch)])  # type: ignore[attr-defined]
    keys = [f"{prefix}{index}" for index in range(batch)]
    got = store.get_many(keys, size)  # type: ignore[attr-defined]
    assert all(item is not None and bytes(item) == value for item in got), "a value did not read back"
    for line in sys.stdin:
        batches = int(line)
        begin = time.perf_counter()
        for _ in range(batches):
            store.get_many(keys, size)  # type: ignore[attr-defined]
        print(batch * batches / (time.perf_counter() - begin), flush=True)
    store.clear()  # type: ignore[attr-defined]
    store.close()  # type: ignore[attr-defined]


class Worker:
    """A worker process reading with the kvgroups of ``source`` (a ``src`` directory)."""

    def __init__(self, source: Path, url: str, batch: int, size: int, keep_heap: bool) -> None:
        root = Path(__file__).resolve().parents[2]
        environment = {**os.environ, "PYTHONPATH": f"{source}:{root}"}
        if keep_heap:
            environment.update(MALLOC_MMAP_THRESHOLD_=str(64 * MIB), MALLOC_TRIM_THRESHOLD_=str(1 << 30))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.store.batch_reads", "--worker", url, str(batch), str(size)],
            cwd=root, env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def rate(self, batches: int) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{batches}\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the worker exited with {self.process.wait()}")
        return float(answer)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def redis_benchmark(port: int, op: str, size: int, requests: int, connections: int) -> float:
    """Requests per second of ``redis-benchmark -t OP -P 16 -c CONNECTIONS -d SIZE``."""
    output = subprocess.run(["redis-benchmark", "-p", str(port), "-t", op, "-P", str(PIPELINE), "-c",
                             str(connections), "-d", str(size), "-n", str(requests), "-q"],
                            capture_output=True, text=True, check=True, timeout=600).stdout
    rates = re.findall(r"([\d.]+) requests per second", output.replace("\r", "\n"))
    if not rates:
        raise RuntimeError(f"unexpected redis-benchmark output: {output[-300:]!r}")
    return float(rates[-1])


def shape_rows(port: int, url: str, sources: dict[str, Path], batch: int, size: int, rounds: int,
               keep_heap: bool) -> list[str]:
    values = max(batch, BYTES_PER_MEASUREMENT // size)
    batches = max(1, values // batch)
    workers = {name: Worker(source, url, batch, size, keep_heap) for name, source in sources.items()}
    anchors = {connections: f"redis-benchmark -P {PIPELINE} -c {connections}" for connections in (1, 4)}
    rates: dict[str, list[float]] = {name: [] for name in [*workers, *anchors.values()]}
    try:
        for round_ in range(rounds + 1):  # the first round warms up, and is not counted
            measured = {}
            for name, client in workers.items():
                measured[name] = client.rate(batches)
            for connections, name in anchors.items():
                redis_benchmark(port, "set", size, PIPELINE * connections, connections)
                measured[name] = redis_benchmark(port, "get", size, batch * batches, connections)
            if round_:
                for name, rate in measured.items():
                    rates[name].append(rate)
    finally:
        for client in workers.values():
            client.close()
    label = f"{batch} x {size // KIB} KiB" if size < MIB else f"{batch} x {size // MIB} MiB"
    rows = []
    for name, values_per_second in rates.items():
        ratios = [statistics.median(ours / theirs for ours, theirs in zip(values_per_second, rates[anchor],
                                                                             strict=True))
                  for anchor in anchors.values()]
        gib = statistics.median(values_per_second) * size / (1 << 30)
        rows.append(f"| {label} | {name} | {statistics.median(values_per_second):.0f} | {gib:.2f} | "
                    f"{ratios[0]:.2f} | {ratios[1]:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="rounds counted (one more warms up)")
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="another tree's src directory whose kvgroups is timed too (repeatable)")
    parser.add_argument("--keep-heap", action="store_true", help="workers' glibc keeps freed memory (see above)")
    parser.add_argument("--worker", nargs=3, metavar=("URL", "BATCH", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return
    print(f"kvgroups workers' heap: {'kept (MALLOC_TRIM_THRESHOLD_)' if args.keep_heap else 'as glibc keeps it'}\n")
    print("| batch | client | values/s | GiB/s | vs redis-benchmark -P 16 -c 1 | vs -P 16 -c 4 |")
    print("|---|---|---|---|---|---|")
    if shutil.which("redis-benchmark") is None or installed_server() is None:
        print(UNMEASURED.row("the Redis tier's batch reads", "no redis-benchmark or server installed", columns=6))
        UNMEASURED.exit()
        return
    here = Path(__file__).resolve().parents[2] / "src"
    sources = {"kvgroups get_many": here}
    sources.update({f"kvgroups get_many ({source.resolve().parent.name})": source for source in args.compare})
    with tempfile.TemporaryDirectory() as root, running_server(Path(root) / "server") as server:
        for batch, size in SHAPES:
            for line in shape_rows(server.port, server.url, sources, batch, size, args.rounds, args.keep_heap):
                print(line, flush=True)
    UNMEASURED.exit()


if __name__ == "__main__":
    main()
