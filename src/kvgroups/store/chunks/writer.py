"""The chunk store's background writer: saves leave the request's path through a queue bounded in bytes.

``submit`` never blocks: a save that would take the queue past its byte budget is dropped at
once (counted; the caller logs it, rate-limited) rather than stall a request behind a slow
store. A job that fails is counted. ``flush(timeout)`` and ``close(timeout)`` wait up to a
deadline and say whether everything was written. At interpreter exit every writer still open
writes what it holds, up to :data:`EXIT_DEADLINE_SECONDS` in all, and logs how many saves it
could not write.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]
# How long an exiting interpreter waits for the writers' pending saves, all writers together.
EXIT_DEADLINE_SECONDS = 30.0
_OPEN_WRITERS: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


class BackgroundWriter:
    """One daemon thread running queued jobs in order, holding at most ``max_pending_bytes`` of them."""

    def __init__(self, max_pending_bytes: int, name: str = "kvgroups-store-writer") -> None:
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.dropped = 0
        self.failed = 0
        self.written = 0
        self._jobs: collections.deque[tuple[Job, int]] = collections.deque()
        self._condition = threading.Condition()
        self._running = 0  # jobs taken off the queue and not finished
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _OPEN_WRITERS.add(self)

    def submit(self, job: Job, num_bytes: int) -> bool:
        """Queue ``job``, which holds ``num_bytes`` until it has run; False (dropped, counted) when the
        queue cannot take that many more bytes, or the writer is closed."""
        with self._condition:
            # One save larger than the whole budget still goes through an empty queue.
            if self._closing or (self.pending_bytes and self.pending_bytes + num_bytes > self.max_pending_bytes):
                self.dropped += 1
                return False
            self._jobs.append((job, num_bytes))
            self.pending_bytes += num_bytes
            self._condition.notify_all()
        return True

    @property
    def pending_jobs(self) -> int:
        with self._condition:
            return len(self._jobs) + self._running

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._jobs and not self._closing:
                    self._condition.wait()
                if not self._jobs:
                    return
                job, num_bytes = self._jobs.popleft()
                self._running += 1
            try:
                job()
                self.written += 1
            except Exception as error:  # a store that fails costs a save, never the writer
                self.failed += 1
                logger.debug("chunk store: a save failed: %s: %s", type(error).__name__, error)
            finally:
                with self._condition:
                    self._running -= 1
                    self.pending_bytes -= num_bytes
                    self._condition.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job queued so far has run, up to ``timeout`` seconds; whether they all did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._condition:
            while self._jobs or self._running:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._condition.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (up to ``timeout``), then stop; whether everything was written."""
        flushed = self.flush(timeout)
        with self._condition:
            self._closing = True
            lost = len(self._jobs) + (0 if flushed else self._running)
            self._jobs.clear()
            self._condition.notify_all()
        if flushed:
            self._thread.join(timeout)
        if lost:
            logger.warning("chunk store: %d queued saves were not written before the writer closed", lost)
        _OPEN_WRITERS.discard(self)
        return flushed and not lost


@atexit.register
def _flush_at_exit() -> None:
    """Write every open writer's pending saves before the interpreter goes, up to the deadline."""
    deadline = time.monotonic() + EXIT_DEADLINE_SECONDS
    for writer in list(_OPEN_WRITERS):
        writer.close(max(0.0, deadline - time.monotonic()))
