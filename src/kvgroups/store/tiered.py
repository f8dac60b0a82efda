"""A list of stores as one: reads try them in order and copy hits into the faster ones; writes go to all.

A tier that fails is skipped with a warning: a read then costs the next tier, a write lands in
the others. Only when every tier fails does an operation raise :class:`StoreError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from kvgroups.store.base import ByteStore, StoreError, Value

logger = logging.getLogger(__name__)


class TieredStore(ByteStore):
    """``tiers`` fastest first (memory, then disk, then a shared server)."""

    def __init__(self, tiers: Sequence[ByteStore]) -> None:
        if not tiers:
            raise StoreError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self.url = " + ".join(tier.url for tier in self.tiers)

    def _failed(self, tier: ByteStore, action: str, error: OSError) -> None:
        logger.warning("store tier %s failed to %s (%s); using the other tiers", tier.url, action, error)

    def put(self, key: str, value: Value) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        failures = []
        for tier in self.tiers:
            try:
                tier.put_many(items)
            except OSError as error:
                self._failed(tier, "write", error)
                failures.append(error)
        if len(failures) == len(self.tiers):
            raise StoreError(f"every tier failed to write: {'; '.join(map(str, failures))}")

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        found: list[bytes | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        failures = 0
        for depth, tier in enumerate(self.tiers):
            if not missing:
                break
            try:
                values = tier.get_many([keys[index] for index in missing])
            except OSError as error:
                self._failed(tier, "read", error)
                failures += 1
                continue
            hits = [(index, value) for index, value in zip(missing, values, strict=True) if value is not None]
            for index, value in hits:
                found[index] = value
            if hits and depth:
                self._promote([(keys[index], value) for index, value in hits], depth)
            missing = [index for index, value in zip(missing, values, strict=True) if value is None]
        if failures == len(self.tiers):
            raise StoreError("every tier failed to read")
        return found

    def _promote(self, items: list[tuple[str, bytes]], depth: int) -> None:
        for tier in self.tiers[:depth]:
            try:
                tier.put_many(items)
            except OSError as error:
                self._failed(tier, "take a copy of a hit", error)

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        present = [False] * len(keys)
        failures = 0
        for tier in self.tiers:
            unknown = [index for index, known in enumerate(present) if not known]
            if not unknown:
                break
            try:
                answers = tier.contains_many([keys[index] for index in unknown])
            except OSError as error:
                self._failed(tier, "look up", error)
                failures += 1
                continue
            for index, answer in zip(unknown, answers, strict=True):
                present[index] = answer
        if failures == len(self.tiers):
            raise StoreError("every tier failed to look up")
        return present

    def delete(self, key: str) -> bool:
        deleted = False
        for tier in self.tiers:
            try:
                deleted |= tier.delete(key)
            except OSError as error:
                self._failed(tier, "delete", error)
        return deleted

    def size_of(self, key: str) -> int | None:
        for tier in self.tiers:
            size = tier.size_of(key)
            if size is not None:
                return size
        return None

    def iter_keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for tier in self.tiers:
            for key in tier.iter_keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def clear(self) -> int:
        return max(tier.clear() for tier in self.tiers)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
