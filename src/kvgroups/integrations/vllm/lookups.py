"""Store lookups for the scheduler: answered from existence only, in background threads where a store may be slow.

vLLM's scheduler asks ``get_num_new_matched_tokens`` for every waiting request on every step, and
every running request waits meanwhile. A lookup asks only whether entries exist (no body is read:
the worker reads and checks each one once, when it loads). On a store whose every tier is on this
machine (files) that is a few ``stat`` calls, answered at once; on a server (Valkey/Redis) it is a
round trip that may hang, so it runs in one of a few background threads and the request is
answered ``None`` ("ask again") until it is done, as vLLM's connector API allows. Each request's
answer is kept until the request finishes, so a request is looked up once.

:class:`KnownPrefixes` remembers which prefix keys this process saw stored (a lookup found them, a
step saved them), so that vLLM's ``may_load_async``, asked for every arriving request, can guess a hit
from a few hashes and a dictionary, never the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvgroups.store.chunks.seen import SeenEntries

logger = logging.getLogger(__name__)

# Lookups running at once; more wait in the queue.
LOOKUP_THREADS = 2
# Lookups queued or running at most; a request beyond it is a miss (the store is not keeping up).
MAX_PENDING_LOOKUPS = 256
# Tiers answered at once: reading existence there is a few system calls on this machine.
_LOCAL_SCHEMES = ("file:", "memory:")
# Prefix keys KnownPrefixes keeps, the most recently seen: about 5 MiB of 64-character keys.
MAX_KNOWN_PREFIXES = 1 << 15


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
        answer = self.known(request_id)
        if answer is not None:
            return answer
        if self._pool is None:
            answer = self._answers[request_id] = self._guarded(request_id, lookup)
            return answer
        if request_id not in self._pending:
            if len(self._pending) >= self.max_pending:
                self.overflows += 1
                logger.debug("request %s: %d lookups pending, answered as a miss", request_id, len(self._pending))
                answer = self._answers[request_id] = 0
                return answer
            self._pending[request_id] = self._pool.submit(self._guarded, request_id, lookup)
        return None

    def start(self, request_id: str, lookup: Callable[[], int]) -> None:
        """Start ``request_id``'s lookup in the background now, so that its answer may be ready when vLLM
        first asks; nothing where lookups run inline (they never run ahead of the scheduler's question)
        or the queue is full."""
        if (self._pool is not None and request_id not in self._answers and request_id not in self._pending
                and len(self._pending) < self.max_pending):
            self._pending[request_id] = self._pool.submit(self._guarded, request_id, lookup)

    def known(self, request_id: str) -> int | None:
        """``request_id``'s answer if it is known (a finished background lookup collected), else None; starts
        nothing."""
        answer = self._answers.get(request_id)
        if answer is not None:
            return answer
        future = self._pending.get(request_id)
        if future is None or not future.done():
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


class KnownPrefixes(SeenEntries):
    """Prefix keys seen stored by this process, the newest ``capacity`` kept (thread-safe: background
    lookups add to it). A guess, never a promise: an entry evicted or written by a step whose save
    failed is still here, and a hit is only ever served after a lookup."""

    def __init__(self, capacity: int = MAX_KNOWN_PREFIXES) -> None:
        super().__init__(capacity)

    def add(self, keys: Iterable[str]) -> None:
        self.stored(keys)

    def depth(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (a prompt's prefix keys, in order) are known from the first on."""
        with self._lock:
            for index, key in enumerate(keys):
                if key not in self._keys:
                    return index
            return len(keys)

    def __len__(self) -> int:
        return len(self._keys)
