"""What the connector reports to vLLM's real Scheduler: its lookups, loads and saves, and hits by tier.

The scheduler side's and the worker's store counts travel as vLLM's connector stats (the worker's
in each step's output, the scheduler's added by the Scheduler itself), and the tokens each tier
served reach vLLM's prefix-cache stats by source (``prompt_tokens_cached_by_source``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tests.integrations.vllm.harness import (
    FakeWorker,
    SchedulerHarness,
    Step,
    cache_config,
    connector_stats,
    prompt,
    vllm_config,
)
from tests.support.servers import running_server

CHUNK = 32


def engine(model_dir: Path, stores: list[str]) -> tuple[SchedulerHarness, FakeWorker]:
    kv = cache_config(["sliding", "full"])
    config = vllm_config(model_dir, {"store": stores, "chunk_size": CHUNK})
    return SchedulerHarness(config, kv), FakeWorker(config, kv, seed=0)


def hits_by_source(steps: list[Step]) -> dict[Any, int]:
    by_source: dict[Any, int] = {}
    for step in steps:
        stats = step.scheduler_stats.connector_prefix_cache_stats if step.scheduler_stats is not None else None
        for source, tokens in (stats.hits_by_source if stats is not None else {}).items():
            by_source[source] = by_source.get(source, 0) + tokens
    return by_source


def test_vllm_gets_the_lookups_loads_and_saves_of_a_hit_and_a_miss(gemma3_dir: Path, tmp_path: Path) -> None:
    store = f"file://{tmp_path}/kv"
    harness, worker = engine(gemma3_dir, [store])
    harness.add("fill", prompt(100))
    filled = connector_stats(harness.run(worker), worker)
    counters = filled.data["counters"]
    # One lookup of the 3 full chunks before the last token (a miss), then 3 chunks saved.
    assert (counters["lookups"], counters["query_tokens"], counters["hit_tokens"]) == (1, 96, 0)
    assert (counters["saved_chunks"], counters["loads"]) == (3, 0)
    # Each chunk: one entry per group (sliding, full), 32 tokens x 1 KiB of K/V each, plus headers.
    assert 6 * 32 * 1024 < counters["save_bytes"] < 6 * 33 * 1024
    assert len(filled.data["seconds"]["save_seconds"]) == 3 and len(filled.data["seconds"]["lookup_seconds"]) == 1

    harness, worker = engine(gemma3_dir, [store])
    harness.add("hit", prompt(100))
    harness.add("miss", prompt(100, seed=1))
    steps = harness.run(worker)
    stats = connector_stats(steps, worker)
    counters = stats.data["counters"]
    assert (counters["lookups"], counters["query_tokens"], counters["hit_tokens"]) == (2, 192, 96)
    # The hit loads 96 tokens: the full group's 3 entries, the sliding window's last one.
    assert (counters["loads"], counters["loaded_tokens"]) == (1, 96)
    assert 4 * 32 * 1024 < counters["load_bytes"] < 4 * 33 * 1024
    assert counters["saved_chunks"] == 3  # the miss's chunks; the loaded ones are not written again
    assert stats.data["tier_hit_tokens"] == {"file": 96}
    assert len(stats.data["seconds"]["load_seconds"]) == 1
    reduced = stats.reduce()
    assert (reduced["hit_rate"], reduced["hit_tokens"], reduced["query_tokens"], reduced["loaded_tokens"]) == (
        0.5, 96, 192, 96)
    assert hits_by_source(steps) == {CacheHitSource.DISK: 96}


def test_hits_are_split_by_the_tier_serving_each_chunk(gemma3_dir: Path, tmp_path: Path) -> None:
    with running_server(tmp_path) as server:
        harness, worker = engine(gemma3_dir, [server.url])
        harness.add("fill", prompt(100))
        harness.run(worker)
        harness, worker = engine(gemma3_dir, [f"file://{tmp_path}/kv", server.url])
        harness.add("first two chunks", prompt(100)[:70])  # 64 tokens from the server, copied to the file tier
        first = harness.run(worker)
        connector_stats(first, worker)
        harness.add("all three", prompt(100))
        second = harness.run(worker)
        assert hits_by_source(first) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 64}
        assert hits_by_source(second) == {CacheHitSource.DISK: 64, CacheHitSource.EXTERNAL_UNSPECIFIED: 32}
        assert connector_stats(second, worker).data["tier_hit_tokens"] == {"file": 64, "redis": 32}


def test_hits_after_a_local_hit_that_ends_inside_a_chunk_are_split_by_token(gemma3_dir: Path, tmp_path: Path) -> None:
    """vLLM's own prefix cache ends on a block (16 tokens), not a chunk (32): the split counts tokens."""
    harness, _ = engine(gemma3_dir, [f"file://{tmp_path}/kv"])
    scheduler = harness.connector._scheduler
    request = SimpleNamespace(request_id="r")
    scheduler._requests["r"] = SimpleNamespace(queried_local=16, chunk_tiers=("file", "file", "redis"))
    assert scheduler.hit_sources(request, 80) == {"file": 48, "redis": 32}
    sources = harness.connector.get_external_cache_hit_sources(request, 80)
    assert sources == {CacheHitSource.DISK: 48, CacheHitSource.EXTERNAL_UNSPECIFIED: 32}
    assert harness.connector.get_external_cache_hit_sources(SimpleNamespace(request_id="gone"), 32) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 32}
