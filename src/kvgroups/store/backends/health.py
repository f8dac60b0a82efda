"""Back-off after a store fails, and warnings that say so without flooding the log.

A store that is down or hung would otherwise cost every request its timeout. After a failure the
store is left alone for :data:`RETRY_AFTER_SECONDS`: requests get misses at once, saves are
dropped (counted), and the next request after that probes it again. Warnings of one kind are
logged at most once per :data:`WARNING_INTERVAL_SECONDS`.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

# After a store fails, it is left alone this long: requests get misses at once instead of timeouts.
RETRY_AFTER_SECONDS = 5.0
WARNING_INTERVAL_SECONDS = 10.0


class RateLimitedLog:
    """``warning`` that logs each kind of message at most once per :data:`WARNING_INTERVAL_SECONDS`."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._last: dict[str, float] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -WARNING_INTERVAL_SECONDS) >= WARNING_INTERVAL_SECONDS:
            self._last[kind] = now
            self._log.warning(message, *args)


class Backoff:
    """Whether a store may be asked now: not for :data:`RETRY_AFTER_SECONDS` after it failed."""

    def __init__(self, name: str, log: RateLimitedLog | None = None) -> None:
        self.name = name
        self.log = log or RateLimitedLog()
        self._failed_at = -float("inf")
        # None: the module's RETRY_AFTER_SECONDS as it is when asked (tests and operators may change it).
        self._retry_after: float | None = None

    def available(self) -> bool:
        retry_after = RETRY_AFTER_SECONDS if self._retry_after is None else self._retry_after
        return time.monotonic() - self._failed_at >= retry_after

    def failed(self, action: str, error: BaseException, retry_after: float | None = None) -> None:
        """Note that ``action`` (lookup, load, save) failed with ``error``; warn (rate-limited). It is left
        alone for ``retry_after`` seconds (default :data:`RETRY_AFTER_SECONDS`)."""
        self._failed_at = time.monotonic()
        self._retry_after = retry_after
        self.log.warning(action, "chunk store %s: %s failed, treating it as a miss for %.1f s: %s", self.name,
                         action, RETRY_AFTER_SECONDS if retry_after is None else retry_after, error)
