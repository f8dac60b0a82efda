"""What the chunk store does, counted: hits, bytes, latencies, errors, per tier where it applies.

Every number is a plain Python counter or a histogram of fixed buckets, updated where the work
happens (a few hundred nanoseconds an operation), so they cost next to nothing whether or not
anybody reads them. :mod:`kvgroups.store.metrics.prometheus` exports every live store's numbers to
Prometheus at scrape time, summed per label (``tier``: memory, file, redis, redis-cluster); no
label ever holds a key, a prompt or a request id. The names and meanings are listed in
docs/metrics.md.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# Latency buckets (seconds): from a memory hit to a timeout.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# What a store failure counts as (kvgroups_errors_total{kind}): each error class of the store names its kind here.
ERROR_TIMEOUT, ERROR_UNAVAILABLE, ERROR_CORRUPT, ERROR_TOO_LARGE, ERROR_FULL, ERROR_UNACKNOWLEDGED = (
    "timeout", "unavailable", "corrupt", "too_large", "full", "unacknowledged")
ERROR_KINDS = (ERROR_TIMEOUT, ERROR_UNAVAILABLE, ERROR_CORRUPT, ERROR_TOO_LARGE, ERROR_FULL, ERROR_UNACKNOWLEDGED)
# Why a save was dropped (kvgroups_dropped_saves_total{reason}): the writer's queue was full, the store was
# backed off after a failure, or no pinned buffer was free to pack it into.
DROP_QUEUE_FULL, DROP_BACKED_OFF, DROP_NO_BUFFER = "queue_full", "backed_off", "no_buffer"
DROP_REASONS = (DROP_QUEUE_FULL, DROP_BACKED_OFF, DROP_NO_BUFFER)


# Observations a histogram keeps for a reporter that forwards each one (vLLM's own histograms), at most.
RECENT_LIMIT = 65536


@dataclass
class Histogram:
    """Counts of observations per bucket (``le`` bounds of :data:`SECONDS_BUCKETS`, then +Inf), and their sum.

    ``recent`` (off unless a reporter turns it on with :meth:`keep_recent`) keeps the observations
    since the reporter last took them, for metrics systems that take values one by one.
    """

    counts: list[int] = field(default_factory=lambda: [0] * (len(SECONDS_BUCKETS) + 1))
    total: float = 0.0
    recent: deque[float] | None = None

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(SECONDS_BUCKETS, value)] += 1
        self.total += value
        if self.recent is not None:
            self.recent.append(value)  # a deque: safe against a reporter taking them on another thread

    def keep_recent(self) -> None:
        if self.recent is None:
            self.recent = deque(maxlen=RECENT_LIMIT)

    def take_recent(self) -> list[float]:
        """The observations since the last call (the oldest dropped beyond :data:`RECENT_LIMIT`)."""
        recent = self.recent
        if recent is None:
            return []
        return [recent.popleft() for _ in range(len(recent))]

    @property
    def count(self) -> int:
        return sum(self.counts)

    def merge(self, other: Histogram) -> None:
        """Add ``other``'s counts and sum (its recent observations stay its own)."""
        self.counts = [mine + theirs for mine, theirs in zip(self.counts, other.counts, strict=True)]
        self.total += other.total


@dataclass
class TierMetrics:
    """What one tier (a byte store) did: its reads, hits and errors, whether it is backed off now."""

    tier: str
    gets: int = 0  # values asked for
    hits: int = 0  # values it had
    promotions: int = 0  # hits copied into it from a slower tier
    promotion_failures: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))
    backed_off: bool = False

    def error(self, kind: str) -> None:
        self.errors[kind] += 1


@dataclass
class StoreMetrics:
    """What one chunk store did (``KVChunkStore.stats``): every count since it was opened."""

    tier: str  # the store's tier, or its tiers joined by "+" for a list of tiers
    num_groups: int = 0
    lookups: int = 0
    query_tokens: int = 0  # tokens of the full chunks lookups asked about (a partial chunk never hits)
    hit_tokens: int = 0  # tokens lookups found (the hit rate is hit_tokens / query_tokens)
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, per tier serving them
    lookup_seconds: Histogram = field(default_factory=Histogram)
    loads: int = 0  # prefixes loaded or verified (read, checked, decoded)
    loaded_tokens: int = 0
    # Loads that restored fewer tokens than asked: an entry gone, corrupt or unreadable since the lookup
    # promised it (a vLLM worker's load then restores none, and vLLM recomputes the request).
    short_loads: int = 0
    load_seconds: Histogram = field(default_factory=Histogram)
    bytes_read: list[int] = field(default_factory=list)  # entry bytes read and checked, per group
    saved_chunks: int = 0  # chunks written (one entry per group the chunk holds)
    save_bytes: int = 0  # entry bytes written
    save_seconds: Histogram = field(default_factory=Histogram)  # encode and write, on the writer
    dropped_saves: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    failed_saves: int = 0
    failed_reads: int = 0  # lookups and loads the store failed (down, hung, refused)
    corrupt_entries: int = 0
    # Entries this process saved or saw stored that a later lookup found missing (lost in a failover, evicted).
    vanished_entries: int = 0
    tiers: list[TierMetrics] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.bytes_read:
            self.bytes_read = [0] * self.num_groups

    @property
    def load_bytes(self) -> int:
        return sum(self.bytes_read)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def summary(self) -> dict[str, object]:
        """The numbers as plain values (for JSON and the CLI): counters, and count and total seconds per
        histogram; per tier its reads, hits, promotions and the errors that happened."""
        plain: dict[str, object] = {"tier": self.tier, "hit_rate": round(self.hit_rate, 4)}
        for name in ("lookups", "query_tokens", "hit_tokens", "loads", "loaded_tokens", "short_loads", "load_bytes",
                     "saved_chunks", "save_bytes", "dropped_saves", "failed_saves", "failed_reads", "corrupt_entries",
                     "vanished_entries"):
            plain[name] = getattr(self, name)
        plain["hit_tokens_by_tier"] = dict(self.hit_tokens_by_tier)
        plain["dropped_by_reason"] = {reason: count for reason, count in self.dropped_by_reason.items() if count}
        for name in ("lookup_seconds", "load_seconds", "save_seconds"):
            histogram: Histogram = getattr(self, name)
            plain[name] = {"count": histogram.count, "total": round(histogram.total, 6)}
        plain["tiers"] = {tier.tier: {"gets": tier.gets, "hits": tier.hits, "promotions": tier.promotions,
                                      "errors": {kind: count for kind, count in tier.errors.items() if count}}
                          for tier in self.tiers}
        return plain

    def looked_up(self, query_tokens: int, tokens_by_tier: Mapping[str, int], seconds: float) -> None:
        self.lookups += 1
        self.query_tokens += query_tokens
        for tier, tokens in tokens_by_tier.items():
            self.hit_tokens += tokens
            self.hit_tokens_by_tier[tier] = self.hit_tokens_by_tier.get(tier, 0) + tokens
        self.lookup_seconds.observe(seconds)

    def loaded(self, tokens: int, seconds: float, *, short: bool = False) -> None:
        """A load of ``tokens`` in ``seconds``; ``short``: fewer than it was asked for."""
        self.loads += 1
        self.loaded_tokens += tokens
        self.short_loads += short
        self.load_seconds.observe(seconds)

    def saved(self, entry_bytes: int, seconds: float) -> None:
        self.saved_chunks += 1
        self.save_bytes += entry_bytes
        self.save_seconds.observe(seconds)

    def dropped(self, reason: str) -> None:
        self.dropped_saves += 1
        self.dropped_by_reason[reason] += 1


class Registry:
    """The live chunk stores' metrics (weakly held: a store that is gone is no longer exported) and the
    tiers' own numbers that only a tier knows (entries, bytes, evictions), read at scrape time."""

    def __init__(self) -> None:
        self._stores: weakref.WeakKeyDictionary[object, StoreMetrics] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def add(self, owner: object, metrics: StoreMetrics) -> None:
        with self._lock:
            self._stores[owner] = metrics

    def items(self) -> Iterator[tuple[object, StoreMetrics]]:
        with self._lock:
            return iter(list(self._stores.items()))


REGISTRY = Registry()
