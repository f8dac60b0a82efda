"""The Mooncake tier against Mooncake's own client moving the same bytes, on one pool, in one run.

A master on loopback and a second process lending the pool its memory (as a serving node would), so that
every value crosses the transfer engine (TCP here). Two clients in this process lend nothing: kvgroups'
``mooncake://`` tier, and Mooncake's ``MooncakeDistributedStore`` itself with one buffer of its own,
registered once, that every batch is written from (``batch_put_from``) and read into (``batch_get_into``).
The tier writes a batch from the caller's buffers (``put_many`` of views, as the chunk store hands them)
and reads it with ``get_many`` (``max_bytes`` the value's size, as the chunk store asks), values handed out
as views of a buffer of the read's own. Batches of 16 x 1 MiB and 64 x 64 KiB, each written under new keys
(as content-keyed chunks are) and read back; ours and theirs alternate (A, B, A, B, ...), and the ratio is
the median over the rounds of their time / our time (1.00: as fast as Mooncake's own client).
``python -m benchmarks.store.mooncake [--rounds N]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.unmeasured import Unmeasured
from kvgroups.core.sizes import KIB, MIB
from kvgroups.store import open_store
from kvgroups.store.backends.mooncake.store import KEY_PREFIX

UNMEASURED = Unmeasured()
SHAPES = ((16, MIB), (64, 64 * KIB))
BYTES_PER_MEASUREMENT = 64 * MIB  # each side moves this much per measurement (several batches)


class Theirs:
    """Mooncake's own client: one registered buffer every batch is written from and read into."""

    def __init__(self, master: Any, nbytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.client = MooncakeDistributedStore()
        code = self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", f"127.0.0.1:{master.rpc_port}")
        if code != 0:
            raise RuntimeError(f"Mooncake's client did not set up: {code}")
        self.buffer = np.empty(nbytes, dtype=np.uint8)
        self.buffer[:] = np.arange(nbytes) % 251
        if self.client.register_buffer(self.buffer.ctypes.data, nbytes) != 0:
            raise RuntimeError("Mooncake's client did not register its buffer")

    def put(self, keys: list[str], size: int) -> None:
        codes = self.client.batch_put_from(keys, [self.buffer.ctypes.data + index * size for index in range(len(keys))],
                                           [size] * len(keys))
        assert all(code == 0 for code in codes), codes

    def get(self, keys: list[str], size: int) -> None:
        codes = self.client.batch_get_into(keys, [self.buffer.ctypes.data + index * size for index in range(len(keys))],
                                           [size] * len(keys))
        assert all(code == size for code in codes), codes

    def remove(self, keys: list[str]) -> None:
        self.client.batch_remove(keys, True)


class Ours:
    """kvgroups' mooncake:// tier: writes from the caller's views, reads into buffers of its own."""

    def __init__(self, url: str, nbytes: int) -> None:
        self.store: Any = open_store(url)
        self.source = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)

    def put(self, keys: list[str], size: int) -> None:
        view = memoryview(self.source.data).cast("B")
        self.store.put_many([(key, view[index * size:(index + 1) * size]) for index, key in enumerate(keys)])

    def get(self, keys: list[str], size: int) -> None:
        values = self.store.get_many(keys, size)
        assert all(value is not None and len(value) == size for value in values)

    def remove(self, keys: list[str]) -> None:
        self.store.client.call("remove", "batch_remove", [KEY_PREFIX + key for key in keys], True)


def measured(client: Ours | Theirs, name: str, batch: int, size: int, batches: int, round_: int) -> tuple[float, float]:
    """Seconds to write ``batches`` batches under new keys, then to read them all back."""
    keys = [[f"{name}-{round_}-{number}-{index}" for index in range(batch)] for number in range(batches)]
    begin = time.perf_counter()
    for batch_keys in keys:
        client.put(batch_keys, size)
    wrote = time.perf_counter()
    for batch_keys in keys:
        client.get(batch_keys, size)
    read = time.perf_counter()
    for batch_keys in keys:
        client.remove(batch_keys)
    return wrote - begin, read - wrote


def rows(rounds: int) -> list[str]:
    from tests.support.mooncake import lending_client, running_master

    lines = []
    with tempfile.TemporaryDirectory() as directory, running_master(Path(directory) / "master") as master, \
            lending_client(master.url(segment="1GiB", timeout=30)):
        largest = max(batch * size for batch, size in SHAPES)
        ours, theirs = Ours(master.url(segment="0", timeout=30), largest), Theirs(master, largest)
        for batch, size in SHAPES:
            batches = max(1, BYTES_PER_MEASUREMENT // (batch * size))
            times: dict[str, list[tuple[float, float]]] = {"ours": [], "theirs": []}
            for round_ in range(rounds + 1):  # round 0 warms up
                pair = [("ours", ours), ("theirs", theirs)]
                for name, client in pair if round_ % 2 else pair[::-1]:
                    result = measured(client, name, batch, size, batches, round_)
                    if round_:
                        times[name].append(result)
            label = f"{batch} x {size // MIB} MiB" if size >= MIB else f"{batch} x {size // KIB} KiB"
            moved = batches * batch * size / (1 << 30)
            for op, column in (("write", 0), ("read", 1)):
                ratio = statistics.median(their[column] / our[column]
                                          for our, their in zip(times["ours"], times["theirs"], strict=True))
                lines.append(f"| {label} | {op} | {moved / statistics.median(t[column] for t in times['ours']):.2f} | "
                             f"{moved / statistics.median(t[column] for t in times['theirs']):.2f} | {ratio:.2f} |")
        ours.store.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=9)
    arguments = parser.parse_args()
    print("| batch | op | kvgroups mooncake:// GiB/s | Mooncake's client GiB/s | kvgroups vs Mooncake's client |")
    print("|---|---|---|---|---|")
    try:
        import mooncake.store  # noqa: F401 - only to say why nothing was measured
    except ImportError as error:
        print(UNMEASURED.row("the Mooncake tier", f"Mooncake's client is not installed ({error})", columns=5))
        UNMEASURED.exit()
        return
    for line in rows(arguments.rounds):
        print(line, flush=True)
    UNMEASURED.exit()


if __name__ == "__main__":
    main()
