"""The connector's stats as vLLM handles them: changes since the last step, summed over processes,
reduced for the log line and exported as vllm:kvgroups_* with vLLM's labels."""

from __future__ import annotations

import functools
import pickle
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvgroups.integrations.vllm.stats import KVGroupsConnectorStats, KVGroupsPromMetrics, StatsReporter
from kvgroups.store.metrics.counters import StoreMetrics, TierMetrics


def _metrics() -> StoreMetrics:
    return StoreMetrics(tier="memory+file", num_groups=2, tiers=[TierMetrics("memory"), TierMetrics("file")])


def test_a_reporter_hands_over_what_changed_since_its_last_report() -> None:
    metrics = _metrics()
    reporter = StatsReporter(metrics)
    assert reporter.take() is None  # nothing happened
    metrics.looked_up(64, {"memory": 16, "file": 32}, 0.002)
    metrics.loaded(48, 0.03)
    metrics.bytes_read[0] += 3000
    metrics.dropped("queue_full")
    metrics.tiers[1].error("timeout")
    first = reporter.take()
    assert first is not None
    assert first["counters"]["lookups"] == 1 and first["counters"]["query_tokens"] == 64
    assert first["counters"]["hit_tokens"] == 48 and first["counters"]["load_bytes"] == 3000
    assert first["tier_hit_tokens"] == {"memory": 16, "file": 32}
    assert first["dropped_saves"] == {"queue_full": 1, "backed_off": 0, "no_buffer": 0}
    assert first["errors"]["file/timeout"] == 1 and first["errors"]["memory/timeout"] == 0
    assert first["seconds"] == {"lookup_seconds": [0.002], "load_seconds": [0.03], "save_seconds": []}
    assert reporter.take() is None  # reported once
    metrics.saved(5000, 0.5)
    second = reporter.take()
    assert second is not None and second["counters"]["saved_chunks"] == 1 and second["counters"]["lookups"] == 0
    assert pickle.loads(pickle.dumps(second)) == second  # vLLM moves it between processes


def test_stats_from_the_scheduler_and_workers_add_up_and_reduce_for_the_log_line() -> None:
    scheduler, worker = _metrics(), _metrics()
    scheduler_side, worker_side = StatsReporter(scheduler), StatsReporter(worker)
    scheduler.looked_up(128, {"file": 96}, 0.001)
    worker.loaded(96, 0.02)
    worker.loaded(0, 0.04)
    worker.bytes_read[1] += 3 << 20
    worker.saved(1 << 20, 0.1)
    worker.failed_reads += 1
    total = KVGroupsConnectorStats(data=worker_side.take() or {})
    total = total.aggregate(KVGroupsConnectorStats(data=scheduler_side.take() or {}))
    assert isinstance(total, KVGroupsConnectorStats) and not total.is_empty()
    assert total.reduce() == {"hit_rate": 0.75, "hit_tokens": 96, "query_tokens": 128, "loaded_tokens": 96,
                              "load_MiB": 3.0, "save_MiB": 1.0, "lookup_ms_mean": 1.0, "load_ms_mean": 30.0,
                              "save_ms_mean": 100.0, "failed_reads": 1}
    total.reset()
    assert total.is_empty()


def test_prometheus_shows_the_sums_with_vllms_labels() -> None:
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    prom = KVGroupsPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                               {0: ["tiny", "0"]})
    metrics = _metrics()
    reporter = StatsReporter(metrics)
    metrics.looked_up(64, {"file": 32}, 0.002)
    metrics.loaded(32, 0.03)
    metrics.dropped("no_buffer")
    metrics.tiers[0].error("corrupt")
    prom.observe(reporter.take() or {}, engine_idx=0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvgroups_query_tokens_total", labels) == 64
    assert registry.get_sample_value("vllm:kvgroups_hit_tokens_total", labels) == 32
    assert registry.get_sample_value("vllm:kvgroups_loaded_tokens_total", labels) == 32
    assert registry.get_sample_value("vllm:kvgroups_load_seconds_count", labels) == 1
    assert registry.get_sample_value("vllm:kvgroups_load_seconds_bucket", {**labels, "le": "0.05"}) == 1
    assert registry.get_sample_value("vllm:kvgroups_load_seconds_bucket", {**labels, "le": "0.025"}) == 0
    assert registry.get_sample_value("vllm:kvgroups_tier_hit_tokens_total", {**labels, "tier": "file"}) == 32
    assert registry.get_sample_value("vllm:kvgroups_dropped_saves_total", {**labels, "reason": "no_buffer"}) == 1
    assert registry.get_sample_value("vllm:kvgroups_errors_total",
                                     {**labels, "tier": "memory", "kind": "corrupt"}) == 1
