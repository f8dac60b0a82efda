"""The metrics count exactly what a known workload does, on every tier and a tier list, and
Prometheus shows the same numbers.

The workload, through PrefixCache on a hybrid (three gated-DeltaNet layers and one full-attention
layer: two groups that need different entries): prompt A (4 full chunks and a token), prompt B
sharing A's first 3 chunks, then prompt C sharing nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvgroups.integrations.transformers import PrefixCache
from kvgroups.store import ByteStore, FileStore, MemoryStore, TieredStore, open_store
from kvgroups.store.metrics.counters import ERROR_KINDS, SECONDS_BUCKETS, Registry
from kvgroups.store.metrics.prometheus import Collector
from tests.support.servers import Server, running_server
from tests.support.tiny_models import tiny_model

CHUNK = 8
TIERS = ["memory", "file", "redis", "memory+file"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("metrics-redis")) as started:
        yield started


def _store(tier: str, directory: Path, server: Server) -> ByteStore:
    if tier == "memory":
        return MemoryStore()
    if tier == "file":
        return FileStore(directory / "kv")
    if tier == "redis":
        store = open_store(server.url)
        store.clear()
        return store
    return TieredStore([MemoryStore(), FileStore(directory / "kv")])


def _prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    a = torch.randint(3, 256, (4 * CHUNK + 1,), generator=generator)
    b = torch.cat([a[: 3 * CHUNK], torch.randint(3, 256, (CHUNK + 1,), generator=generator)])
    c = torch.randint(3, 256, (4 * CHUNK + 1,), generator=generator)
    assert not torch.equal(b[3 * CHUNK:4 * CHUNK], a[3 * CHUNK:4 * CHUNK])
    return a, b, c


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.mark.parametrize("tier", TIERS)
def test_every_counter_and_histogram_counts_the_workload_exactly(tier: str, tmp_path: Path, server: Server) -> None:
    model: Any = tiny_model("qwen3_5_text")
    store = _store(tier, tmp_path, server)
    a, b, c = _prompts()
    with PrefixCache(model, store, chunk_size=CHUNK) as cache:
        chunk_store = cache.chunk_store
        groups = chunk_store.groups
        # Token groups (the full-attention layer) read every chunk of B's prefix, recurrent groups (the
        # DeltaNet layers' conv and recurrent states) only their state after the last chunk.
        reads = [3 if group.token_indexed else 1 for group in groups]
        assert sorted(reads) == [1, 1, 3]
        assert cache.prefill(a).reused_tokens == 0
        cache.flush()
        if tier == "memory+file":
            store.tiers[0].clear()  # as after a restart: only the file tier has A's entries
        assert cache.prefill(b).reused_tokens == 3 * CHUNK
        assert cache.prefill(c).reused_tokens == 0
        cache.flush()

        # Each entry's bytes, as the store holds them (every entry of a group has one size).
        key = chunk_store.keys(a)[0]
        entry_bytes = [store.size_of(chunk_store.entry_key(key, group)) or 0 for group in range(len(groups))]
        assert all(entry_bytes)
        read_bytes = [count * size for count, size in zip(reads, entry_bytes, strict=True)]

        stats = cache.stats
        assert stats is chunk_store.stats
        assert stats.tier == tier
        # Three lookups of 4 full chunks each (the last token is always computed); B found 3.
        assert (stats.lookups, stats.query_tokens, stats.hit_tokens) == (3, 3 * 4 * CHUNK, 3 * CHUNK)
        assert stats.hit_rate == pytest.approx(3 / 12)
        served_by = "file" if tier == "memory+file" else tier
        assert stats.hit_tokens_by_tier == {served_by: 3 * CHUNK}
        # One load of B's 3 chunks.
        assert (stats.loads, stats.loaded_tokens, stats.short_loads) == (1, 3 * CHUNK, 0)
        assert stats.bytes_read == read_bytes and stats.load_bytes == sum(read_bytes)
        # Saved: A's 4 chunks, B's 4th, C's 4; each chunk an entry per group.
        assert stats.saved_chunks == 9 and stats.save_bytes == 9 * sum(entry_bytes)
        assert (stats.lookup_seconds.count, stats.load_seconds.count, stats.save_seconds.count) == (3, 1, 9)
        for histogram in (stats.lookup_seconds, stats.load_seconds, stats.save_seconds):
            assert len(histogram.counts) == len(SECONDS_BUCKETS) + 1 and histogram.total > 0
        assert (stats.dropped_saves, stats.failed_saves, stats.failed_reads, stats.corrupt_entries) == (0, 0, 0, 0)
        assert stats.dropped_by_reason == {"queue_full": 0, "backed_off": 0, "no_buffer": 0}

        # Per tier: the values asked for and found, promotions, no errors.
        by_tier = {metrics.tier: metrics for metrics in stats.tiers}
        if tier == "memory+file":
            assert sorted(by_tier) == ["file", "memory"]
            assert (by_tier["memory"].gets, by_tier["memory"].hits, by_tier["memory"].promotions) == (5, 0, 5)
            assert (by_tier["file"].gets, by_tier["file"].hits, by_tier["file"].promotions) == (5, 5, 0)
        else:
            assert (by_tier[tier].gets, by_tier[tier].hits) == (5, 5)
        assert all(metrics.errors == dict.fromkeys(ERROR_KINDS, 0) for metrics in stats.tiers)

        # Prometheus shows the same numbers, summed per tier label.
        stores = Registry()
        stores.add(chunk_store, stats)
        registry = CollectorRegistry()
        registry.register(Collector(stores))
        assert _sample(registry, "kvgroups_lookups_total", tier=tier) == 3
        assert _sample(registry, "kvgroups_query_tokens_total", tier=tier) == 96
        assert _sample(registry, "kvgroups_hit_tokens_total", tier=tier) == 24
        assert _sample(registry, "kvgroups_tier_hit_tokens_total", tier=served_by) == 24
        assert _sample(registry, "kvgroups_load_bytes_total", tier=tier) == sum(read_bytes)
        assert _sample(registry, "kvgroups_save_bytes_total", tier=tier) == 9 * sum(entry_bytes)
        assert _sample(registry, "kvgroups_saved_chunks_total", tier=tier) == 9
        assert _sample(registry, "kvgroups_load_seconds_count", tier=tier) == 1
        assert _sample(registry, "kvgroups_save_seconds_count", tier=tier) == 9
        assert _sample(registry, "kvgroups_lookup_seconds_bucket", tier=tier, le="+Inf") == 3
        assert _sample(registry, "kvgroups_dropped_saves_total", tier=tier, reason="queue_full") == 0
        assert _sample(registry, "kvgroups_errors_total", tier=served_by, kind="corrupt") == 0
        assert _sample(registry, "kvgroups_save_queue_bytes", tier=tier) == 0
        assert _sample(registry, "kvgroups_backed_off", tier=tier) == 0
        if tier != "redis":
            # What the first tier holds: every entry saved (A's were dropped in the tier list, then B's 5
            # read ones promoted back), one file per entry on disk.
            first = "file" if tier == "file" else "memory"
            held = 9 * len(groups) if tier in ("memory", "file") else 5 * len(groups) + 5
            expected_bytes = sum(store.tiers[0].size_of(name) or 0 for name in store.tiers[0].iter_keys())
            if first == "memory":
                assert _sample(registry, "kvgroups_entries", tier=first) == held
            assert len(list(store.tiers[0].iter_keys())) == held
            assert _sample(registry, "kvgroups_evictions_total", tier=first) == 0
            assert (_sample(registry, "kvgroups_bytes", tier=first) or 0) >= expected_bytes > 0


def test_errors_are_counted_by_kind_on_the_tier_that_failed(tmp_path: Path) -> None:
    from kvgroups.store import KVChunkStore
    from tests.support.stored_chunks import MIXED_KINDS, TOKENS, build_metadata, chunk_tensors

    metadata = build_metadata(MIXED_KINDS)
    # corrupt: a flipped byte in a memory entry, found by a load.
    with KVChunkStore(metadata, MemoryStore()) as store:
        for chunk in range(5):
            store.save(TOKENS, chunk, chunk_tensors(store, TOKENS, chunk))
        store.flush()
        victim = store.entry_key(store.keys(TOKENS)[0], 0)
        value = bytearray(store.store.get(victim) or b"")
        value[-1] ^= 1
        store.store.put(victim, bytes(value))
        assert store.load(TOKENS, store.lookup(TOKENS)).num_tokens == 0
        assert store.stats.corrupt_entries == 1 and store.stats.tiers[0].errors["corrupt"] == 1
        assert (store.stats.loads, store.stats.short_loads) == (1, 1)  # asked for what the lookup found: got none
    # too_large: a memory tier smaller than an entry in front of a file tier refuses every save.
    small = MemoryStore(max_bytes=64)
    with KVChunkStore(metadata, TieredStore([small, FileStore(tmp_path / "kv")])) as store:
        store.save(TOKENS, 0, chunk_tensors(store, TOKENS, 0))
        store.flush()
        assert small.tier_metrics.errors["too_large"] == 1 and store.stats.saved_chunks == 1
    # timeout: a server that accepts connections and never answers; then the store is backed off, so
    # a save is dropped for that reason and the gauge says so.
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0?timeout=0.2"
        with KVChunkStore(metadata, url, max_pending_bytes=1 << 20) as store:
            assert store.lookup(TOKENS) == 0
            assert store.stats.failed_reads == 1 and store.stats.tiers[0].errors["timeout"] == 1
            assert not store.save_chunk(store.keys(TOKENS)[0], 0, {0: chunk_tensors(store, TOKENS, 0)[0]})
            assert store.stats.dropped_by_reason["backed_off"] == 1
            assert store.gauges()["backed_off"][("redis",)] == 1
    # unavailable: nobody listens. (queue_full: tests/store/test_saves.py::test_saves_never_block_on_a_slow_store)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with KVChunkStore(metadata, f"redis://127.0.0.1:{port}/0") as store:
        assert store.lookup(TOKENS) == 0 and store.stats.tiers[0].errors["unavailable"] == 1
