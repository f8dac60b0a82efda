"""What the connector tells vLLM: the store's counts since the last step, through vLLM's connector stats.

Each side of the connector (the scheduler's lookups, the workers' loads and saves) hands vLLM the
changes of its store's :class:`~kvgroups.store.metrics.counters.StoreMetrics` since its last report
(:class:`StatsReporter`); vLLM sums the workers' and the scheduler's (``aggregate``), shows
``reduce()`` in its periodic log line (``KV Transfer metrics: hit_rate=...``) and hands the sums to
:class:`KVGroupsPromMetrics`, which exports them on vLLM's own ``/metrics`` as ``vllm:kvgroups_*``
with vLLM's labels (model_name, engine) and the few of ours (tier, kind, reason). The payload is
plain dicts, lists and numbers: vLLM pickles it between processes and msgpacks it to its front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvgroups.store.metrics.counters import DROP_REASONS, ERROR_KINDS, SECONDS_BUCKETS, StoreMetrics
from kvgroups.store.metrics.prometheus import COUNTERS, HISTOGRAMS

PREFIX = "vllm:kvgroups_"  # vLLM keeps and re-registers only metrics named vllm:*
_MIB = float(1 << 20)
# The scheduler side's own counts (a store counts the rest), exported beside the store's counters.
CONNECTOR_COUNTERS = {
    "continued_hits": "requests whose store hit continued a hit of vLLM's own prefix cache",
    "continued_local_tokens": "of those requests' prompts, the tokens vLLM's own prefix cache served",
    "continued_store_tokens": "of those requests' prompts, the tokens the store served after them",
    "decode_saves": "chunks saved that hold generated tokens (save_decode): a conversation's next turn loads them",
    "decode_chunk_loads": "chunks loaded that this server saved from generated tokens",
    "stateless_saves": "a hybrid's saves (one request's step) that stored no recurrent state: none can end a hit",
    "early_loads": "requests whose load may start while vLLM's running batch is full (may_load_async)",
    "early_load_misses": "of those, the ones whose lookup found nothing beyond vLLM's own cache to load",
    "handovers_sent": "P/D prefills whose response told the decode server what the store holds",
    "handovers_received": "P/D decode requests that carried a prefill server's hand-over",
    "handover_tokens": "of those, the prompt tokens found in the store and loaded",
    "handover_waits_expired": "hand-overs not all in the store when the wait ran out (the rest computed)",
    "handover_delay_ms": "ms from each prefill's end to its decode server finding its chunks, summed",
}


@dataclass
class ConnectorCounts:
    """What the scheduler side counts itself (:data:`CONNECTOR_COUNTERS`), since it started."""

    continued_hits: int = 0
    continued_local_tokens: int = 0
    continued_store_tokens: int = 0
    decode_saves: int = 0
    decode_chunk_loads: int = 0
    stateless_saves: int = 0
    early_loads: int = 0
    early_load_misses: int = 0
    handovers_sent: int = 0
    handovers_received: int = 0
    handover_tokens: int = 0
    handover_waits_expired: int = 0
    handover_delay_ms: int = 0

    def continued(self, local_tokens: int, store_tokens: int) -> None:
        """A hit of ``store_tokens`` from the store planned after ``local_tokens`` of vLLM's own."""
        self.continued_hits += 1
        self.continued_local_tokens += local_tokens
        self.continued_store_tokens += store_tokens


class StatsReporter:
    """The changes of one store's metrics (and the scheduler's own counts) since the previous :meth:`take`
    (None when nothing changed)."""

    def __init__(self, metrics: StoreMetrics, counts: ConnectorCounts | None = None) -> None:
        self.metrics = metrics
        self.counts = counts
        for name in HISTOGRAMS:
            getattr(metrics, name).keep_recent()
        self._last: dict[str, int] = {}

    def _delta(self, name: str, value: int) -> int:
        change = value - self._last.get(name, 0)
        self._last[name] = value
        return change

    def take(self) -> dict[str, Any] | None:
        metrics = self.metrics
        counters = {name: self._delta(name, getattr(metrics, name)) for name in COUNTERS}
        if self.counts is not None:
            counters.update({name: self._delta(name, getattr(self.counts, name)) for name in CONNECTOR_COUNTERS})
        hit_tokens = {tier: self._delta(f"hit:{tier}", tokens) for tier, tokens in metrics.hit_tokens_by_tier.items()}
        dropped = {reason: self._delta(f"dropped:{reason}", count)
                   for reason, count in metrics.dropped_by_reason.items()}
        errors = {f"{tier.tier}/{kind}": self._delta(f"error:{tier.tier}/{kind}", count)
                  for tier in metrics.tiers for kind, count in tier.errors.items()}
        seconds = {name: getattr(metrics, name).take_recent() for name in HISTOGRAMS}
        data = {"counters": counters, "tier_hit_tokens": hit_tokens, "dropped_saves": dropped, "errors": errors,
                "seconds": seconds}
        return data if not _empty(data) else None


def _empty(data: dict[str, Any]) -> bool:
    return not any(any(part.values()) for part in (data.get("counters", {}), data.get("tier_hit_tokens", {}),
                                                   data.get("dropped_saves", {}), data.get("errors", {}),
                                                   data.get("seconds", {})))


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for section, values in other.items():
        mine = into.setdefault(section, {})
        for name, value in values.items():
            mine[name] = mine.get(name, [] if isinstance(value, list) else 0) + value


@dataclass
class KVGroupsConnectorStats(KVConnectorStats):
    """The connector's counts over an interval: counters, per-tier and per-kind counts, and the seconds
    of each lookup, load and save (``data`` as :meth:`StatsReporter.take` makes it)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        _add(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return _empty(self.data)

    def reduce(self) -> dict[str, int | float]:
        """The interval in vLLM's log line: the hit rate, tokens, MiB moved, mean times, what went wrong."""
        counters: dict[str, int] = self.data.get("counters", {})
        seconds: dict[str, list[float]] = self.data.get("seconds", {})
        query, hits = counters.get("query_tokens", 0), counters.get("hit_tokens", 0)
        reduced: dict[str, int | float] = {
            "hit_rate": round(hits / query, 3) if query else 0.0, "hit_tokens": hits, "query_tokens": query,
            "loaded_tokens": counters.get("loaded_tokens", 0),
            "load_MiB": round(counters.get("load_bytes", 0) / _MIB, 1),
            "save_MiB": round(counters.get("save_bytes", 0) / _MIB, 1),
        }
        for name in HISTOGRAMS:
            values = seconds.get(name, [])
            if values:
                reduced[f"{name.removesuffix('_seconds')}_ms_mean"] = round(1000 * sum(values) / len(values), 2)
        for name in ("continued_hits", "continued_local_tokens", "continued_store_tokens", "short_loads",
                     "decode_saves", "decode_chunk_loads", "dropped_saves", "failed_reads", "failed_saves",
                     "corrupt_entries", "vanished_entries"):
            if counters.get(name):
                reduced[name] = counters[name]
        return reduced


class KVGroupsPromMetrics(KVConnectorPromMetrics):
    """The connector's counts on vLLM's ``/metrics``: ``vllm:kvgroups_*`` counters and histograms with
    vLLM's labels, and ``tier``, ``reason`` or ``kind`` where the metric says so."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(self._counter_cls(name=PREFIX + name, documentation=text,
                                                             labelnames=labelnames), per_engine_labelvalues)
            for name, text in {**COUNTERS, **CONNECTOR_COUNTERS}.items()}
        self._histograms = {
            name: create_metric_per_engine(self._histogram_cls(name=PREFIX + name, documentation=text,
                                                               labelnames=labelnames, buckets=list(SECONDS_BUCKETS)),
                                           per_engine_labelvalues)
            for name, text in HISTOGRAMS.items()}
        # Metrics with labels of ours: children bound as values arrive.
        self._labelled = {
            "tier_hit_tokens": self._counter_cls(name=PREFIX + "tier_hit_tokens", labelnames=[*labelnames, "tier"],
                                                 documentation="of the hit tokens, those each tier serves"),
            "dropped_saves": self._counter_cls(name=PREFIX + "dropped_saves", labelnames=[*labelnames, "reason"],
                                               documentation=f"saves dropped ({', '.join(DROP_REASONS)})"),
            "errors": self._counter_cls(name=PREFIX + "errors", labelnames=[*labelnames, "tier", "kind"],
                                        documentation=f"store failures per tier ({', '.join(ERROR_KINDS)})"),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for name, value in data.get("counters", {}).items():
            if value and name in self._counters:
                self._counters[name][engine_idx].inc(value)
        for name, values in data.get("seconds", {}).items():
            if name in self._histograms:
                for value in values:
                    self._histograms[name][engine_idx].observe(value)
        engine = self.per_engine_labelvalues[engine_idx]
        for section in ("tier_hit_tokens", "dropped_saves", "errors"):
            for label, value in data.get(section, {}).items():
                if value:
                    self._labelled[section].labels(*engine, *label.split("/")).inc(value)
