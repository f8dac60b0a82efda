"""A worker's asynchronous loads: a few background threads, each reading into one reused buffer, and their results.

vLLM admits a request whose hit loads asynchronously as ``WAITING_FOR_REMOTE_KVS``, holding its
blocks, and goes on running the others; the worker reports the request in ``finished_recving``
(and, if the load failed, in ``failed_recving`` too, so that vLLM recomputes it) once the load is
done, whether or not the request was aborted meanwhile, since vLLM frees its blocks only then.
Every load submitted is therefore reported exactly once, whatever happens to it, and only once the
copies it launched have completed (its event on a GPU): a job returning is not its copies being done,
and blocks reported while a copy still writes them could be handed to another request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvgroups.datapath.streams import DONE, Completion

logger = logging.getLogger(__name__)

# Loads running at once: each is bound by reading the store and copying memory, beside the model.
LOAD_THREADS = 2
# A job restores a request into its blocks, reading into its thread's buffers: whether it restored all of
# it, and the end of its copies.
Job = Callable[[Any], tuple[bool, Completion]]


class BackgroundLoads:
    """Loads run by ``threads`` threads, each with buffers from ``make_buffer`` it reuses for every entry."""

    def __init__(self, make_buffer: Callable[[], Any], threads: int = LOAD_THREADS) -> None:
        self._make_buffer = make_buffer
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgroups-load")
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._copying: dict[str, tuple[bool, Completion]] = {}  # ended, their copies maybe not yet
        self._running = 0
        self._idle = threading.Condition(self._lock)

    def submit(self, request_id: str, job: Job) -> None:
        """Run ``job(buffer)`` in the background; the request is reported by :meth:`take` once its copies are done."""
        with self._lock:
            self._running += 1
        try:
            self._pool.submit(self._run, request_id, job)
        except RuntimeError:  # shut down: the request must still be reported, as failed
            self._done(request_id, False, DONE)

    def _run(self, request_id: str, job: Job) -> None:
        restored, copies = False, DONE
        try:
            buffer = getattr(self._local, "buffer", None)
            if buffer is None:
                buffer = self._local.buffer = self._make_buffer()
            restored, copies = job(buffer)
        except Exception:  # a load must never take the engine down: vLLM recomputes the request
            logger.exception("request %s: loading its stored prefix failed", request_id)
        finally:
            self._done(request_id, restored, copies)

    def _done(self, request_id: str, restored: bool, copies: Completion) -> None:
        with self._lock:
            self._copying[request_id] = (restored, copies)
            self._running -= 1
            self._idle.notify_all()

    def _collect(self) -> None:
        """Move the loads whose copies completed to the finished (and failed) sets; the lock is held."""
        for request_id, (restored, copies) in list(self._copying.items()):
            if copies.query():
                del self._copying[request_id]
                self._finished.add(request_id)
                if not restored:
                    self._failed.add(request_id)

    def take(self) -> tuple[set[str], set[str]]:
        """Requests whose loads ended, copies included, since the last call (every one, failed or not), and
        those that failed."""
        with self._lock:
            self._collect()
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
        return finished, failed

    def wait_for_one(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds until some load has ended (at once when one has, or none runs).

        For an engine step with nothing to compute: without it the engine loops on empty steps as fast
        as it can, holding the interpreter's lock the loading threads need between their copies.
        """
        with self._lock:
            self._idle.wait_for(lambda: self._copying or self._finished or not self._running, timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no load runs and every load's copies are done (up to ``timeout`` seconds for the
        loads); whether none runs."""
        with self._lock:
            idle = self._idle.wait_for(lambda: self._running == 0, timeout)
            copying = [copies for _, copies in self._copying.values()]
        for copies in copying:
            copies.synchronize()
        return idle

    def close(self) -> None:
        """Let running loads finish (they write into the engine's caches), then stop the threads."""
        self._pool.shutdown(wait=True)
