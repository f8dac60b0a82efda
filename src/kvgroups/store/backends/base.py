"""What every byte store offers: put/get/contains/delete of values by key, batch forms, listing.

A byte store keeps opaque values (stored entries) under string keys. Failures of the medium raise
:class:`StoreError` (:class:`StoreTimeoutError` for a server that does not answer in time,
:class:`StoreFullError` for a medium that stays full after eviction); a value the tier cannot
take raises :class:`EntryTooLargeError`. The chunk store turns all of them into misses; it never
lets them reach a request. Reads take ``max_bytes``: a value longer than that is returned cut to
``max_bytes + 1`` bytes, so a caller sees it is too long without a tier reading all of it.
"""

from __future__ import annotations

import abc
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvgroups.errors import KVGroupsError
from kvgroups.store.metrics.counters import (
    ERROR_FULL,
    ERROR_TIMEOUT,
    ERROR_TOO_LARGE,
    ERROR_UNACKNOWLEDGED,
    ERROR_UNAVAILABLE,
    TierMetrics,
)

# Guards the lazy creation of a tier's metrics (two chunk stores may open over one tier at once).
_TIER_METRICS_LOCK = threading.Lock()


class StoreError(OSError):
    """A store could not be read or written (unreachable, full, refused); callers degrade to a miss."""

    kind = ERROR_UNAVAILABLE  # what the metrics count it as (kvgroups_errors_total{kind})


class StoreTimeoutError(StoreError):
    """A store did not answer within its timeout (a hung server, a saturated connection pool)."""

    kind = ERROR_TIMEOUT


class StoreFullError(StoreError):
    """A store's medium stayed full after evicting down to its low watermark."""

    kind = ERROR_FULL


class UnacknowledgedWriteError(StoreError):
    """Some values of a write are not saved as asked: their server (a cluster's master) is down, or fewer
    replicas than the store waits for acknowledged them. The store itself answers; only these values count
    as not saved (no back-off)."""

    kind = ERROR_UNACKNOWLEDGED


class EntryTooLargeError(KVGroupsError):
    """A value is larger than the tier accepts; the message says both sizes."""

    kind = ERROR_TOO_LARGE


def error_kind(error: BaseException) -> str:
    """What a store failure counts as in the metrics: its own ``kind``; a client library's timeout
    (builtin or redis-py's, whose classes share the name) is a timeout; anything else unavailable."""
    kind = getattr(error, "kind", None)
    if isinstance(kind, str):
        return kind
    timed_out = isinstance(error, TimeoutError) or type(error).__name__ == "TimeoutError"
    return ERROR_TIMEOUT if timed_out else ERROR_UNAVAILABLE


@dataclass(frozen=True)
class StoreStats:
    entries: int
    bytes: int


class ByteStore(abc.ABC):
    """Values by key. Thread-safe; the batch forms exist where a tier does them in one round trip."""

    url: str
    tier_name = "store"  # the metrics' tier label: memory, file, redis, redis-cluster
    # Whether other deployments may keep their entries here too (a server): clearing it then asks first.
    shared = False
    # Called with the keys a tier drops on its own (its evictions), on the thread that dropped them,
    # where the tier can tell (memory and file tiers; a server's evictions are the server's).
    eviction_listener: Callable[[list[str]], None] | None = None

    # When this store last answered a key as absent without asking where it would be (time.monotonic()).
    _unanswered_at = -math.inf

    def note_unanswered(self) -> None:
        """Some keys were answered as absent without being asked for (a tier backed off, a master down)."""
        self._unanswered_at = time.monotonic()

    def unanswered_since(self, moment: float) -> bool:
        """Whether, since ``moment`` (``time.monotonic()``), some key was answered as absent without its
        server or tier being asked: a miss then says nothing of whether the entry is still stored."""
        return self._unanswered_at >= moment

    @property
    def tier_metrics(self) -> TierMetrics:
        """This tier's own numbers (values asked for and found, errors by kind), counted by its caller."""
        with _TIER_METRICS_LOCK:
            metrics: TierMetrics | None = self.__dict__.get("_tier_metrics")
            if metrics is None:
                metrics = self.__dict__["_tier_metrics"] = TierMetrics(self.tier_name)
        return metrics

    @property
    def tiers(self) -> list[ByteStore]:
        """The tiers this store is made of: itself, or a tier list's tiers."""
        return [self]

    def record_read(self, asked: int, found: int) -> None:
        """Count a read of ``asked`` values of which ``found`` were there (a tier list counts each tier
        as it asks it instead)."""
        metrics = self.tier_metrics
        metrics.gets += asked
        metrics.hits += found

    def record_error(self, error: BaseException) -> None:
        """Count a failure of this store by its kind (a tier list counts each tier's instead)."""
        self.tier_metrics.error(error_kind(error))

    def backed_off(self) -> dict[str, bool]:
        """Per tier name, whether the store leaves that tier alone now (a tier list's back-offs)."""
        return {}

    def gauges(self) -> dict[str, float]:
        """What only the tier knows, where it knows it: ``entries``, ``bytes``, ``evictions``."""
        return {}

    def locate_many(self, keys: Sequence[str]) -> list[int | None]:
        """For each key, the index in :attr:`tiers` of the first tier holding it, None when none does."""
        return [0 if present else None for present in self.contains_many(keys)]

    @abc.abstractmethod
    def put(self, key: str, value: Value) -> None: ...

    @abc.abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        """The value under ``key`` (cut to ``max_bytes + 1`` bytes when longer), None when absent."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""

    def discard_served(self, key: str, bad: Stored, max_bytes: int) -> bool:
        """Remove the copy of ``key`` a read served as ``bad`` (it did not check out; a value longer than
        ``max_bytes`` is bad whatever it holds); whether another tier still holds a different copy, which
        a read would serve next. One store holds one copy: it is removed, none is left."""
        self.delete(key)
        return False

    @abc.abstractmethod
    def iter_keys(self) -> Iterator[str]:
        """Every key stored (for stats, verify and clear; not for the request path)."""

    @abc.abstractmethod
    def size_of(self, key: str) -> int | None:
        """Bytes stored under ``key``, None when absent."""

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        for key, value in items:
            self.put(key, value)

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[Stored | None]:
        return [self.get(key, max_bytes) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(key) for key in keys]

    def get_into(self, key: str, buffer: memoryview) -> Stored | None:
        """The value under ``key`` read into ``buffer`` (a writable byte view), as a view of the part it
        fills; None when absent. At most ``buffer.nbytes`` bytes are read: a value that fills the
        buffer may be longer, so a caller sizes it one byte past the longest value it accepts. Tiers
        that can read straight into the buffer do (files); the others copy into it.
        """
        return _copied_into(self.get(key, buffer.nbytes - 1), buffer)

    def get_many_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[Stored | None]:
        """Each key's value read into its buffer, as :meth:`get_into` reads one, the batch asked at once: the
        values are read together (one round trip where the tier has batches), then copied into the buffers.
        A tier that reads straight into a buffer (files) reads each so."""
        if not keys:
            return []
        values = self.get_many(keys, max(buffer.nbytes for buffer in buffers) - 1)
        return [_copied_into(value, buffer) for value, buffer in zip(values, buffers, strict=True)]

    def get_prefix(self, key: str, num_bytes: int) -> Stored | None:
        """The first ``num_bytes`` bytes of a value (an entry's header), None when absent."""
        value = self.get(key, num_bytes)
        return None if value is None else value[:num_bytes]

    def stats(self) -> StoreStats:
        sizes = [self.size_of(key) for key in self.iter_keys()]
        present = [size for size in sizes if size is not None]
        return StoreStats(entries=len(present), bytes=sum(present))

    def clear(self) -> int:
        """Delete every entry of this store (only kvgroups' own); how many went."""
        return sum(self.delete(key) for key in list(self.iter_keys()))

    def close(self) -> None:  # noqa: B027 - tiers without a connection have nothing to close
        """Release connections and files."""

    def __enter__(self) -> ByteStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        # ``url`` never holds a password (tiers mask it), so it is safe to show.
        return f"{type(self).__name__}({self.url!r})"


Value = bytes | bytearray | memoryview
# What a read returns: a buffer of its own (never shared with another read), or a view of one.
Stored = bytes | bytearray | memoryview


def _copied_into(value: Stored | None, buffer: memoryview) -> Stored | None:
    """``value`` (None: absent) copied into the start of ``buffer``, as much as fits, as a view of the part
    it fills."""
    if value is None:
        return None
    view = memoryview(value).cast("B")
    count = min(view.nbytes, buffer.nbytes)
    buffer[:count] = view[:count]
    return buffer[:count]


def cut(value: bytes, max_bytes: int | None) -> bytes:
    """``value``, or its first ``max_bytes + 1`` bytes when it is longer than ``max_bytes``."""
    return value if max_bytes is None or len(value) <= max_bytes else value[:max_bytes + 1]


def check_value(key: object, value: object) -> Value:
    """``value``, when ``key`` is a str and ``value`` bytes-like; raises TypeError otherwise.

    Tiers that write a value out at once (files, servers) take the caller's buffer as it is; a
    tier that keeps it (memory) keeps a copy of anything but ``bytes``.
    """
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    raise TypeError(f"store values are bytes, got {type(value).__name__} for key {key!r}")
