"""A worker's asynchronous loads: a few background threads, each reading into one reused buffer, and their results.

vLLM admits a request whose hit loads asynchronously as ``WAITING_FOR_REMOTE_KVS``, holding its
blocks, and goes on running the others; the worker reports the request in ``finished_recving``
(and, if the load failed, in ``failed_recving`` too, so that vLLM recomputes it) once the load is
done, whether or not the request was aborted meanwhile, since vLLM frees its blocks only then.
Every load submitted is therefore reported exactly once, whatever happens to it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

# Loads running at once: each is bound by reading the store and copying memory, beside the model.
LOAD_THREADS = 2
Job = Callable[[bytearray], bool]


class BackgroundLoads:
    """Loads run by ``threads`` threads, each with a buffer from ``make_buffer`` it reuses for every entry."""

    def __init__(self, make_buffer: Callable[[], bytearray], threads: int = LOAD_THREADS) -> None:
        self._make_buffer = make_buffer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgroups-load")
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._running = 0
        self._idle = threading.Condition(self._lock)

    def submit(self, request_id: str, job: Job) -> None:
        """Run ``job(buffer)`` (whether it restored the request) in the background; reported by :meth:`take`."""
        with self._lock:
            self._running += 1
        try:
            self._pool.submit(self._run, request_id, job)
        except RuntimeError:  # shut down: the request must still be reported, as failed
            self._done(request_id, False)

    def _run(self, request_id: str, job: Job) -> None:
        restored = False
        try:
            buffer = getattr(self._local, "buffer", None)
            if buffer is None:
                buffer = self._local.buffer = self._make_buffer()
            restored = job(buffer)
        except Exception:  # a load must never take the engine down: vLLM recomputes the request
            logger.exception("request %s: loading its stored prefix failed", request_id)
        finally:
            self._done(request_id, restored)

    def _done(self, request_id: str, restored: bool) -> None:
        with self._lock:
            self._finished.add(request_id)
            if not restored:
                self._failed.add(request_id)
            self._running -= 1
            self._idle.notify_all()

    def take(self) -> tuple[set[str], set[str]]:
        """Requests whose loads ended since the last call (every one, failed or not), and those that failed."""
        with self._lock:
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
        return finished, failed

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no load runs (up to ``timeout`` seconds); whether none does."""
        with self._lock:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def close(self) -> None:
        """Let running loads finish (they write into the engine's caches), then stop the threads."""
        self._pool.shutdown(wait=True)
