"""Saves never block the caller and are not lost: a queue bounded in bytes, deadlines, a flush at exit,
and host memory from a bounded pool for what is queued."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvgroups.datapath.buffers import HostBufferPool
from kvgroups.store import FileStore, KVChunkStore, MemoryStore
from kvgroups.store.backends.base import Value
from kvgroups.store.chunks.writer import BackgroundWriter
from tests.support.paths import ROOT
from tests.support.stored_chunks import build_metadata, chunk_tensors


class SlowStore(MemoryStore):
    """A memory store whose writes take ``seconds`` each (a slow disk, a far server)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.release = threading.Event()

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        self.release.wait(self.seconds)
        super().put_many(items)


def test_saves_never_block_on_a_slow_store() -> None:
    metadata = build_metadata([("full", 0), ("recurrent", 0)], num_kv_heads=8)
    slow = SlowStore(seconds=30)
    tokens = list(range(8 * 20))
    one_chunk = sum(info.tensor_bytes for info in (KVChunkStore(metadata, MemoryStore()).entry_info("k", group, 0)
                                                    for group in range(2)))
    store = KVChunkStore(metadata, slow, max_pending_bytes=5 * one_chunk)
    keys = store.keys(tokens)
    begin = time.monotonic()
    for chunk in range(20):
        store.save(tokens, chunk, chunk_tensors(store, tokens, chunk), keys=keys)
    assert time.monotonic() - begin < 1.0  # twenty saves against a store that takes 30 s per write
    # The writer holds five chunks' bytes (one being written, four queued); the rest are dropped, counted.
    assert store.stats.dropped_saves == 20 - 5 and store.stats.dropped_by_reason["queue_full"] == 20 - 5
    assert store.gauges()["save_queue_bytes"][("memory",)] == 5 * one_chunk
    assert not store.flush(timeout=0.2)  # a deadline, and the answer that not everything is written
    slow.release.set()
    assert store.flush(timeout=10)
    assert store.stats.saved_chunks == 5 and store.close(timeout=5)


def test_close_says_what_it_could_not_write() -> None:
    writer = BackgroundWriter(max_pending_bytes=1 << 20)
    gate = threading.Event()
    done: list[int] = []
    assert writer.submit(lambda: (gate.wait(5), done.append(1)), 10)
    assert writer.submit(lambda: done.append(2), 10)
    assert writer.pending_bytes == 20
    assert not writer.close(timeout=0.1)  # the first still runs, the second never will
    gate.set()
    assert not writer.submit(lambda: done.append(3), 10)  # a closed writer takes nothing
    time.sleep(0.2)
    assert done == [1]


def test_a_process_that_exits_without_close_writes_its_saves(tmp_path: Path) -> None:
    """No close(), no flush(): the saves still queued when the interpreter exits are written first."""
    script = textwrap.dedent("""
        import sys, time
        from kvgroups.store import KVChunkStore
        from tests.support.stored_chunks import build_metadata, chunk_tensors
        store = KVChunkStore(build_metadata([("full", 0)]), sys.argv[1])
        tokens = list(range(8 * 20))
        keys = store.keys(tokens)
        for chunk in range(20):
            store.save(tokens, chunk, chunk_tensors(store, tokens, chunk), keys=keys)
        print(store._writer.pending_jobs, flush=True)  # most of them still queued
    """)
    url = f"file://{tmp_path}/kv"
    result = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, check=True)
    assert int(result.stdout.strip()) > 0
    store = KVChunkStore(build_metadata([("full", 0)]), url)
    assert store.lookup(list(range(8 * 20))) == 8 * 20  # all 20 chunks are on disk
    assert sum(1 for _ in FileStore(tmp_path / "kv").iter_keys()) == 20


def test_queued_saves_hold_host_memory_from_a_bounded_pool() -> None:
    shape = torch.Size([2, 4, 256, 64])
    each = 2 * 4 * 256 * 64 * 2
    pool = HostBufferPool(max_bytes=3 * each, pin=False)
    first = pool.take([(shape, torch.bfloat16), (shape, torch.bfloat16)])
    assert first is not None and pool.held_bytes == 2 * each
    assert pool.take([(shape, torch.bfloat16), (shape, torch.bfloat16)]) is None  # over the budget: a dropped save
    assert pool.held_bytes == 2 * each
    pool.give_back(first)
    again = pool.take([(shape, torch.bfloat16)])
    assert again is not None and again[0].data_ptr() in {buffer.data_ptr() for buffer in first}  # reused
    other = pool.take([(torch.Size([4, 4, 256, 64]), torch.bfloat16)])  # another shape: free ones make room
    assert other is not None and pool.held_bytes <= 3 * each


def test_a_save_releases_its_buffers_once_encoded() -> None:
    metadata = build_metadata([("full", 0)])
    released = threading.Event()
    slow = SlowStore(seconds=30)
    store = KVChunkStore(metadata, slow)
    tokens = list(range(8))
    assert store.save_chunk(store.keys(tokens)[0], 0, {0: chunk_tensors(store, tokens, 0)[0]},
                            release=released.set)
    assert released.wait(5)  # encoded: the buffer is free, though the write has not happened yet
    assert slow.stats().entries == 0
    slow.release.set()
    assert store.close(timeout=10) and slow.stats().entries == 1
