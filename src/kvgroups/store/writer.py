"""The chunk store's background writer: saves leave the request's path through a bounded queue.

A full queue makes a save wait up to ``wait_seconds`` for room (a healthy store drains it fast),
then drops it (counted and logged) rather than stall the request longer; a write that fails is
logged and counted. ``flush()`` waits until everything queued so far is written or has failed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class BackgroundWriter:
    """One daemon thread running queued jobs in order."""

    def __init__(self, max_pending: int, wait_seconds: float, name: str = "kvgroups-store-writer") -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_pending)
        self.wait_seconds = wait_seconds
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and the save is lost) when the queue stays full."""
        try:
            self._queue.put(job, timeout=self.wait_seconds)
        except queue.Full:
            self.dropped += 1
            logger.warning("chunk store: write queue full, dropping a save (%d dropped so far)", self.dropped)
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except Exception as error:
                self.failed += 1
                logger.warning("chunk store: a save failed: %s: %s", type(error).__name__, error)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every job queued so far has run."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
