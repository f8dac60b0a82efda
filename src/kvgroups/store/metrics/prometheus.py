"""The chunk stores' metrics in Prometheus (``pip install 'kvgroups[metrics]'``): read at scrape time.

:func:`install` registers one collector with prometheus-client's default registry (once per
process); at each scrape it sums every live store's :class:`~kvgroups.store.metrics.counters.StoreMetrics`
per label and yields ``kvgroups_*`` families. Nothing is updated in Prometheus on the request path.
:func:`install` also starts an HTTP endpoint on ``$KVGROUPS_METRICS_PORT`` when that is set, for
processes that serve none of their own; an engine that has one (vLLM's ``/metrics``) exposes
these with its own. Without prometheus-client nothing happens and the counters work all the same.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from kvgroups.store.metrics.counters import DROP_REASONS, ERROR_KINDS, REGISTRY, SECONDS_BUCKETS, Histogram, Registry

logger = logging.getLogger(__name__)

PORT_VARIABLE = "KVGROUPS_METRICS_PORT"
_state = {"installed": False}
_lock = threading.Lock()

# name -> (help, type); the label sets are fixed: tier, and reason or kind where they say so.
COUNTERS = {
    "lookups": "prefix lookups",
    "query_tokens": "tokens lookups asked about (the hit rate is hit_tokens / query_tokens)",
    "hit_tokens": "tokens lookups found stored, every group's needs met",
    "loads": "prefixes loaded (or verified) from the store",
    "loaded_tokens": "tokens of the prefixes loaded",
    "short_loads": "loads that restored fewer tokens than asked (entries gone, corrupt or unreadable since the "
                   "lookup): the engine recomputes the rest",
    "load_bytes": "entry bytes read and checked",
    "saved_chunks": "chunks written (one entry per group the chunk holds)",
    "save_bytes": "entry bytes written",
    "failed_saves": "chunks whose write failed (the store was down, full or refused them)",
    "failed_reads": "lookups and loads that failed (the store was down, hung or refused them)",
    "corrupt_entries": "entries that did not decode or check out (counted misses, deleted)",
    "vanished_entries": "entries this process saved or saw stored that a later lookup found missing (lost with a "
                        "failed-over master that had not passed them to its replica, evicted, expired, deleted)",
}
# A tier's own counters (TierMetrics' fields), exported as kvgroups_tier_<name>_total per tier.
TIER_COUNTERS = {
    "gets": "values asked of a tier",
    "hits": "values a tier had",
    "promotions": "hits copied into a faster tier",
    "promotion_failures": "hits a faster tier did not take (counted, served all the same)",
}
# What the stores and their tiers report of themselves at scrape time (``gauges()``); evictions only grow.
GAUGES = {
    "save_queue_bytes": "bytes of saves waiting for the background writer",
    "backed_off": "1 while a store tier is left alone after a failure",
    "evictions": "entries a tier evicted to stay within its budget",
    "entries": "entries a tier holds (where it knows)",
    "bytes": "bytes a tier holds (where it knows)",
    "backed_off_masters": "masters of a cluster left alone after a failure",
}
GROWING_GAUGES = ("evictions",)
HISTOGRAMS = {
    "lookup_seconds": "time of a lookup (which entries exist)",
    "load_seconds": "time of a load (read, check, decode and put together)",
    "save_seconds": "time of a save on the background writer (encode and write)",
}


def _family(kind: str, name: str, documentation: str, labels: list[str]) -> Any:
    from prometheus_client.core import (  # noqa: PLC0415 - the optional extra
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    family = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
    return family(f"kvgroups_{name}", documentation, labels=labels)


class Collector:
    """Every live chunk store's numbers (of ``stores``: by default every store of the process), summed per
    label, as Prometheus families."""

    def __init__(self, stores: Registry = REGISTRY) -> None:
        self.stores = stores

    def describe(self) -> list[Any]:
        # Without describe(), registering would collect at once, from stores still being opened.
        return []

    def collect(self) -> Iterator[Any]:
        counters: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        histograms: dict[str, dict[str, Histogram]] = defaultdict(dict)
        gauges: dict[str, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
        for owner, metrics in self.stores.items():
            tier = metrics.tier
            for name in COUNTERS:
                counters[name][(tier,)] += getattr(metrics, name)
            for reason in DROP_REASONS:
                counters["dropped_saves"][(tier, reason)] += metrics.dropped_by_reason[reason]
            for name in HISTOGRAMS:
                merged = histograms[name].setdefault(tier, Histogram())
                merged.merge(getattr(metrics, name))
            for name, value in owner.gauges().items():  # type: ignore[attr-defined]
                for labels, number in value.items():
                    gauges[name][labels] += number
            for served_by, tokens in metrics.hit_tokens_by_tier.items():
                counters["tier_hit_tokens"][(served_by,)] += tokens
            for tier_metrics in metrics.tiers:
                for kind in ERROR_KINDS:
                    counters["errors"][(tier_metrics.tier, kind)] += tier_metrics.errors[kind]
                for name in TIER_COUNTERS:
                    counters[f"tier_{name}"][(tier_metrics.tier,)] += getattr(tier_metrics, name)
        documentation = {**COUNTERS, "dropped_saves": f"saves dropped (reason: {', '.join(DROP_REASONS)})",
                         "errors": f"store failures (kind: {', '.join(ERROR_KINDS)}), per tier",
                         "tier_hit_tokens": "of the hit tokens, those each tier serves (a chunk is served by the "
                                            "slowest tier holding one of its entries)",
                         **{f"tier_{name}": text for name, text in TIER_COUNTERS.items()}}
        for name, values in counters.items():
            labels = ["tier", "reason"] if name == "dropped_saves" else ["tier", "kind"] if name == "errors" \
                else ["tier"]
            family = _family("counter", name, documentation[name], labels)
            for label_values, number in sorted(values.items()):
                family.add_metric(list(label_values), number)
            yield family
        for name, per_tier in histograms.items():
            family = _family("histogram", name, HISTOGRAMS[name], ["tier"])
            for tier, histogram in sorted(per_tier.items()):
                cumulative, buckets = 0, []
                for bound, count in zip([*SECONDS_BUCKETS, float("inf")], histogram.counts, strict=True):
                    cumulative += count
                    buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
                family.add_metric([tier], buckets, histogram.total)
            yield family
        for name, values in gauges.items():
            family = _family("counter" if name in GROWING_GAUGES else "gauge", name, GAUGES[name], ["tier"])
            for label_values, number in sorted(values.items()):
                family.add_metric(list(label_values), number)
            yield family


def install() -> bool:
    """Export the stores' metrics to prometheus-client (once); serve them on $KVGROUPS_METRICS_PORT when
    set. Whether prometheus-client is there."""
    with _lock:
        if _state["installed"]:
            return True
        try:
            from prometheus_client import REGISTRY as PROMETHEUS  # noqa: PLC0415 - the optional extra
            from prometheus_client import start_http_server  # noqa: PLC0415
        except ImportError:
            return False
        PROMETHEUS.register(Collector())
        _state["installed"] = True
        port = os.environ.get(PORT_VARIABLE)
        if port:
            try:
                start_http_server(int(port))
                logger.info("kvgroups metrics served on port %s", port)
            except (OSError, ValueError) as error:  # a busy port costs the endpoint, never the store
                logger.warning("cannot serve kvgroups metrics on %s=%r: %s", PORT_VARIABLE, port, error)
        return True
