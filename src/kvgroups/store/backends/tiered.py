"""A list of stores as one: reads try them in order and copy hits into the faster ones; writes go to all.

Each tier fails alone. A tier that fails (down, hung, full) is left alone for a while
(:class:`~kvgroups.store.backends.health.Backoff`) and probed again after it, so a hung server costs at
most one timeout per back-off period, not one per request; a read then costs the next tier, a
write lands in the others. A tier that refuses a value (too large for it) never stops the others.
A hit copied into a faster tier (promotion) that fails is counted, never raised. Only when every
tier fails does an operation raise :class:`StoreError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from operator import methodcaller
from typing import TypeVar

from kvgroups.store.backends.base import (
    ByteStore,
    EntryTooLargeError,
    Stored,
    StoreError,
    UnacknowledgedWriteError,
    Value,
)
from kvgroups.store.backends.health import Backoff, RateLimitedLog

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class TieredStore(ByteStore):
    """``tiers`` fastest first (memory, then disk, then a shared server)."""

    def __init__(self, tiers: Sequence[ByteStore]) -> None:
        if not tiers:
            raise StoreError("a tiered store needs at least one tier")
        self._tiers = list(tiers)
        self.url = " + ".join(tier.url for tier in self._tiers)
        self.shared = any(tier.shared for tier in self._tiers)
        log = RateLimitedLog(logger)
        self.health = [Backoff(tier.url, log) for tier in self._tiers]
        self.tier_name = "+".join(tier.tier_name for tier in self._tiers)

    @property
    def tiers(self) -> list[ByteStore]:
        return list(self._tiers)

    # Each tier's reads and errors are counted as it is asked (below), not the list's as a whole.
    def record_read(self, asked: int, found: int) -> None:
        pass

    def record_error(self, error: BaseException) -> None:
        pass

    def backed_off(self) -> dict[str, bool]:
        return {tier.tier_name: not health.available() for tier, health in zip(self._tiers, self.health, strict=True)}

    def _ask(self, index: int, action: str, call: Callable[[ByteStore], _T]) -> tuple[bool, _T | None]:
        """``call`` on tier ``index`` unless it is backed off: (whether it answered, its answer). A tier
        that fails is backed off."""
        health = self.health[index]
        if not health.available():
            return False, None
        try:
            return True, call(self._tiers[index])
        except UnacknowledgedWriteError:
            raise  # the tier answers; only those values are not saved (put_many counts them)
        except OSError as error:
            self._tiers[index].record_error(error)
            health.failed(action, error)
            return False, None

    def _nobody(self, action: str) -> StoreError:
        return StoreError(f"no tier could {action}: every tier failed or is backed off ({self.url})")

    def put(self, key: str, value: Value) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        answered = 0
        refusals: list[str] = []
        unacknowledged: list[UnacknowledgedWriteError] = []
        for index in range(len(self._tiers)):
            try:
                ok, _ = self._ask(index, "write", lambda store: store.put_many(items))
            except EntryTooLargeError as error:
                refusals.append(str(error))  # this tier cannot hold the value; the others still take it
                self._tiers[index].record_error(error)
                continue
            except UnacknowledgedWriteError as error:
                unacknowledged.append(error)
                self._tiers[index].record_error(error)
                continue
            answered += ok
        if len(refusals) == len(self._tiers):
            raise EntryTooLargeError("no tier takes these values: " + "; ".join(refusals))
        if not answered and unacknowledged:
            raise unacknowledged[0]
        if not answered:
            raise self._nobody("write")

    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        return self.get_many([key], max_bytes)[0]

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[Stored | None]:
        found: list[Stored | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        answered = 0
        for depth in range(len(self._tiers)):
            if not missing:
                break
            asked = missing
            names = [keys[i] for i in asked]
            ok, values = self._ask(depth, "read", methodcaller("get_many", names, max_bytes))
            if not ok or values is None:
                continue
            answered += 1
            hits = [(index, value) for index, value in zip(asked, values, strict=True) if value is not None]
            self._tiers[depth].record_read(len(asked), len(hits))
            for index, value in hits:
                found[index] = value
            if hits and depth:
                self._promote([(keys[index], value) for index, value in hits], depth, max_bytes)
            missing = [index for index, value in zip(asked, values, strict=True) if value is None]
        if not answered and missing:
            raise self._nobody("read")
        return found

    def _promote(self, items: list[tuple[str, Stored]], depth: int, max_bytes: int | None) -> None:
        # A value cut at max_bytes + 1 is longer than any entry: it is not copied anywhere.
        whole = [(key, value) for key, value in items if max_bytes is None or len(value) <= max_bytes]
        for index in range(depth):
            metrics = self._tiers[index].tier_metrics
            try:
                ok, _ = self._ask(index, "write", lambda store: store.put_many(whole))
            except EntryTooLargeError:
                ok = False
            if ok:
                metrics.promotions += len(whole)
            else:
                metrics.promotion_failures += len(whole)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [depth is not None for depth in self.locate_many(keys)]

    def unanswered_since(self, moment: float) -> bool:
        return super().unanswered_since(moment) or any(tier.unanswered_since(moment) for tier in self._tiers)

    def locate_many(self, keys: Sequence[str]) -> list[int | None]:
        located: list[int | None] = [None] * len(keys)
        answered = 0
        for depth in range(len(self._tiers)):
            unknown = [index for index, where in enumerate(located) if where is None]
            if not unknown:
                break
            names = [keys[i] for i in unknown]
            ok, answers = self._ask(depth, "look up", methodcaller("contains_many", names))
            if not ok or answers is None:
                self.note_unanswered()
                continue
            answered += 1
            for index, answer in zip(unknown, answers, strict=True):
                if answer:
                    located[index] = depth
        if not answered and None in located:
            raise self._nobody("look up")
        return located

    def delete(self, key: str) -> bool:
        results = [self._ask(index, "delete", lambda store: store.delete(key)) for index in range(len(self._tiers))]
        return any(bool(deleted) for _, deleted in results)

    def discard_served(self, key: str, bad: Stored, max_bytes: int) -> bool:
        # A read served ``bad`` from the first tier that answered holding the key and promoted it into the
        # tiers in front, unchecked: every tier whose copy is those bytes loses it, in order, up to the first
        # holding another copy, which the next read serves (promoted and checked again by its reader). A tier
        # backed off is not asked, as reads skip it. Only the rare bad read pays these reads.
        bad_bytes = bytes(memoryview(bad).cast("B"))
        for index in range(len(self._tiers)):
            ok, value = self._ask(index, "read", methodcaller("get", key, max_bytes))
            if not ok or value is None:
                continue
            copy = bytes(memoryview(value).cast("B"))
            if copy != bad_bytes and not (len(copy) > max_bytes and len(bad_bytes) > max_bytes):
                return True
            self._ask(index, "delete", lambda store: store.delete(key))
        return False

    def size_of(self, key: str) -> int | None:
        for index in range(len(self._tiers)):
            _, size = self._ask(index, "look up", lambda store: store.size_of(key))
            if size is not None:
                return size
        return None

    def iter_keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for tier in self._tiers:
            for key in tier.iter_keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def clear(self) -> int:
        return max(tier.clear() for tier in self._tiers)

    def close(self) -> None:
        for tier in self._tiers:
            tier.close()
