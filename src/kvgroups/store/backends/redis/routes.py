"""Which connection reads what: a batch's reads spread over a server's connections.

Every read of one connection is asked before its first reply is read
(:func:`kvgroups.store.backends.redis.resp.get_ranges`); a batch large enough is spread over a few
connections, moved at once (a server writes a large reply to one client in small pieces per turn of
its event loop: several clients keep it busy while each one reads).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgroups.core.sizes import MIB

# Bytes of a batch's reads that take a connection of their own, at least: fewer go on fewer connections (a
# connection's round trip costs more than moving them).
SPREAD_BYTES = 4 * MIB


def spread(sizes: Sequence[int], ways: int, least: int) -> list[range]:
    """Consecutive runs of the indices of ``sizes``, at most ``ways`` of them, each holding about the same
    total, and at least ``least`` of it where there are several."""
    total = sum(sizes)
    ways = max(1, min(ways, len(sizes), total // max(least, 1)))
    runs: list[range] = []
    start = running = 0
    for index, size in enumerate(sizes):
        running += size
        if len(runs) < ways - 1 and running * ways >= total * (len(runs) + 1):
            runs.append(range(start, index + 1))
            start = index + 1
    return [run for run in [*runs, range(start, len(sizes))] if run]
