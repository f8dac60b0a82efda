"""Which prefix of SGLang's pages a lookup may restore, from which pages each pool holds.

SGLang's KV pool needs every page of a prefix; a pool beside it says what it needs by its hit policy:
``all_pages`` (every page of the prefix, e.g. an indexer) or ``trailing_pages`` (only the last few pages:
a recurrent state exists where a node of SGLang's tree ended, so a prefix is restorable only where one
was stored). Every restorable length is kept, not just the longest: each tensor-parallel rank holds its
own shard of the states and may hold another set, and SGLang intersects the ranks' sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
POLICIES = (ALL_PAGES, TRAILING_PAGES)


@dataclass(frozen=True)
class PoolPresence:
    """Which of the looked-up pages a pool holds, and what it needs of a prefix."""

    name: str
    policy: str
    trailing_pages: int  # with ``trailing_pages``: how many of the prefix's last pages it needs
    present: Sequence[bool]


@dataclass(frozen=True)
class PrefixHits:
    pages: int  # the longest restorable prefix, in pages
    per_pool: dict[str, int]  # each pool's own longest prefix it could serve (pools with none are left out)
    restorable: list[int]  # every restorable prefix length, ascending


def leading(present: Sequence[bool]) -> int:
    """How many pages from the first are present, up to the first that is not."""
    return next((index for index, there in enumerate(present) if not there), len(present))


def prefix_hits(kv_present: Sequence[bool], pools: Sequence[PoolPresence], kv_name: str = "kv") -> PrefixHits:
    """The prefixes every pool can restore, given the KV pool's pages and each other pool's."""
    kv_pages = leading(kv_present)
    restorable = set(range(1, kv_pages + 1))
    per_pool = {kv_name: kv_pages} if kv_pages else {}
    for pool in pools:
        if not restorable:  # as SGLang's own backends: once nothing is restorable, no pool is asked further
            break
        if pool.policy == TRAILING_PAGES:
            trailing = max(1, pool.trailing_pages)
            allowed = {length for length in range(1, kv_pages + 1)
                       if all(pool.present[max(0, length - trailing): length])}
        elif pool.policy == ALL_PAGES:
            allowed = set(range(1, min(leading(pool.present), kv_pages) + 1))
        else:
            raise ValueError(f"pool {pool.name!r}: hit policy {pool.policy!r}; expected one of {', '.join(POLICIES)}")
        if allowed:
            per_pool[pool.name] = max(allowed)
        restorable &= allowed
    return PrefixHits(max(restorable, default=0), per_pool, sorted(restorable))
