"""Store lookups for the scheduler: answered from existence only, in background threads where a store may be slow.

vLLM's scheduler asks ``get_num_new_matched_tokens`` for every waiting request on every step, and
every running request waits meanwhile. A lookup asks only whether entries exist (no body is read:
the worker reads and checks each one once, when it loads). On a store whose every tier is on this
machine (files) that is a few ``stat`` calls, answered at once; on a server (Valkey/Redis) it is a
round trip that may hang, so it runs in one of a few background threads and the request is
answered ``None`` ("ask again") until it is done, as vLLM's connector API allows. Each request's
answer is kept until the request finishes, so a request is looked up once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)

# Lookups running at once; more wait in the queue.
LOOKUP_THREADS = 2
# Lookups queued or running at most; a request beyond it is a miss (the store is not keeping up).
MAX_PENDING_LOOKUPS = 256
# Tiers answered at once: reading existence there is a few system calls on this machine.
_LOCAL_SCHEMES = ("file:", "memory:")


def all_tiers_local(urls: Sequence[str]) -> bool:
    """Whether every tier of a store is on this machine (a lookup there never waits on a network)."""
    return all(url.startswith(_LOCAL_SCHEMES) for url in urls)


class Lookups:
    """Per-request lookup answers, computed inline or in a bounded pool of background threads.

    ``background`` False answers every lookup at once, in the caller's thread; True answers None
    until the lookup's thread is done. At most ``max_pending`` lookups are queued or running:
    a request past that is answered 0 (a miss) rather than queued behind a store that does not
    keep up.
    """

    def __init__(self, *, background: bool, threads: int = LOOKUP_THREADS,
                 max_pending: int = MAX_PENDING_LOOKUPS) -> None:
        self.background = background
        self.max_pending = max_pending
        self.overflows = 0  # requests answered 0 because the queue was full
        self._answers: dict[str, int] = {}
        self._pending: dict[str, Future[int]] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgroups-lookup") if background else None

    def answer(self, request_id: str, lookup: Callable[[], int]) -> int | None:
        """The hit of ``request_id``: ``lookup()``'s answer, computed once; None while it runs."""
        answer = self._answers.get(request_id)
        if answer is not None:
            return answer
        if self._pool is None:
            answer = self._answers[request_id] = self._guarded(request_id, lookup)
            return answer
        future = self._pending.get(request_id)
        if future is None:
            if len(self._pending) >= self.max_pending:
                self.overflows += 1
                logger.debug("request %s: %d lookups pending, answered as a miss", request_id, len(self._pending))
                answer = self._answers[request_id] = 0
                return answer
            self._pending[request_id] = self._pool.submit(self._guarded, request_id, lookup)
            return None
        if not future.done():
            return None
        del self._pending[request_id]
        answer = self._answers[request_id] = future.result()
        return answer

    @staticmethod
    def _guarded(request_id: str, lookup: Callable[[], int]) -> int:
        try:
            return lookup()
        except Exception:  # a lookup must never take the scheduler down: the request is a miss
            logger.exception("request %s: looking up its prefix failed; a miss", request_id)
            return 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's answer (a lookup still running is left to finish, unread)."""
        self._answers.pop(request_id, None)
        future = self._pending.pop(request_id, None)
        if future is not None:
            future.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
