"""The Mooncake client a store talks through: set up in the background, every call bounded by the store's timeout.

Mooncake's client blocks where kvgroups must not: its setup retries a master that is down for about
90 s, and a call to a hung master waits out a 30 s RPC timeout. So the client is set up on a thread
of its own (the store waits for it at most its timeout; until the client is up, and for :data:`SETUP_RETRY_SECONDS`
after a setup failed, calls fail at once as unavailable: misses), and every call runs on one of
:data:`CALL_THREADS` threads, waited for at most the store's timeout. A call that outlives it keeps its
thread and its arguments (the buffers it reads or writes stay alive until it returns: a transfer still
in flight never lands in freed memory); when every thread is held so, calls fail at once as timeouts
rather than queueing behind them.

Mooncake answers with codes, not exceptions (``types.h``'s ``ErrorCode``); :data:`ABSENT` and
the other sets here say what each means to a store.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from kvgroups.store.backends.base import StoreError, StoreFullError, StoreTimeoutError
from kvgroups.store.backends.health import RateLimitedLog
from kvgroups.store.backends.mooncake.settings import MooncakeSettings

logger = logging.getLogger(__name__)

CALL_THREADS = 8
SETUP_RETRY_SECONDS = 5.0

# Mooncake's ErrorCode values (mooncake-store/include/types.h), by what they mean here.
BUFFER_OVERFLOW, NO_AVAILABLE_HANDLE, INVALID_PARAMS = -10, -200, -600
REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE = -703, -704, -706
TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT = -800, -900, -901
ABSENT = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY})  # not there (or not yet written whole): a miss
TOO_SMALL = frozenset({BUFFER_OVERFLOW, INVALID_PARAMS})  # a read's buffer is smaller than the value
FULL = frozenset({NO_AVAILABLE_HANDLE})  # no segment has room, even after eviction
UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL})  # the master or the holding client failed


def mooncake_module() -> Any:
    """Mooncake's Python client, or a StoreError saying how to install it."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as error:
        raise StoreError(f"a Mooncake store needs Mooncake's client: pip install 'kvgroups[mooncake]' "
                         f"(and, on Debian, apt-get install libibverbs1 librdmacm1 libnuma1) ({error})") from error


class MooncakeClient:
    """One Mooncake client, set up in the background; :meth:`call` runs one of its methods within the timeout."""

    def __init__(self, settings: MooncakeSettings, log: RateLimitedLog | None = None) -> None:
        self.settings = settings
        self._module = mooncake_module()
        self._log = log or RateLimitedLog(logger)
        self._lock = threading.Lock()
        self._store: Any = None
        self._setting_up = False
        self._closed = False
        self._failed_at = -float("inf")
        self._last_failure = ""
        self._ready = threading.Event()
        self._workers = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="kvgroups-mooncake")
        self._free = threading.BoundedSemaphore(CALL_THREADS)
        self._connect()
        # A master that answers sets a client up in milliseconds: the store opens ready. One that does not costs
        # the opener one timeout, and the client is set up in the background from then on.
        self._ready.wait(settings.timeout_seconds)

    def replicate_config(self) -> Any:
        config = self._module.ReplicateConfig()
        config.replica_num = self.settings.replicas
        return config

    # --- set up in the background ----------------------------------------------------------------------
    def _connect(self) -> None:
        with self._lock:
            if self._closed or self._store is not None or self._setting_up or \
                    time.monotonic() - self._failed_at < SETUP_RETRY_SECONDS:
                return
            self._setting_up = True
        threading.Thread(target=self._setup, name="kvgroups-mooncake-setup", daemon=True).start()

    def _setup(self) -> None:
        settings = self.settings
        store = self._module.MooncakeDistributedStore()
        try:
            code = store.setup(settings.client_host(), settings.metadata, settings.segment_bytes,
                               settings.buffer_bytes, settings.protocol, settings.devices, settings.master)
            failure = "" if code == 0 else f"setup answered {code}"
        except Exception as error:
            failure = f"setup raised {type(error).__name__}: {error}"
        with self._lock:
            self._setting_up = False
            if failure or self._closed:
                self._failed_at = time.monotonic()
                self._last_failure = failure or "closed while setting up"
            else:
                self._store = store
                self._ready.set()
        if failure:
            self._log.warning("setup", "Mooncake store %s: cannot reach the master %s (%s); its reads are misses "
                              "and its writes dropped, trying again in %.0f s", settings.url, settings.master,
                              failure, SETUP_RETRY_SECONDS)
        elif self._closed:
            store.close()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the client is set up (tests, tools); whether it is."""
        return self._ready.wait(timeout)

    # --- calls, each within the timeout ------------------------------------------------------------------
    def call(self, action: str, method: str, *arguments: Any, keep: object = None) -> Any:
        """``method`` of the client on ``arguments``, within the store's timeout; raises StoreError when the
        client is not set up, StoreTimeoutError when the call (or every call thread) outlives the timeout.
        ``keep`` (the buffers the call moves by address) is held until the call returns, however late."""
        store = self._store
        if store is None:
            self._connect()
            reason = self._last_failure or "still setting up"
            raise StoreError(f"{self.settings.url}: cannot {action}: not connected to the master "
                             f"{self.settings.master} ({reason})")
        if not self._free.acquire(blocking=False):
            raise StoreTimeoutError(f"{self.settings.url}: cannot {action}: every call thread still waits on the "
                                    f"master (calls that outlived the {self.settings.timeout_seconds:g} s timeout)")
        function: Callable[..., Any] = getattr(store, method)
        future = self._workers.submit(self._run, function, arguments, keep)
        try:
            return future.result(timeout=self.settings.timeout_seconds)
        except FutureTimeoutError:
            raise StoreTimeoutError(f"{self.settings.url}: cannot {action}: no answer within "
                                    f"{self.settings.timeout_seconds:g} s") from None
        except Exception as error:
            raise StoreError(f"{self.settings.url}: cannot {action}: {type(error).__name__}: {error}") from error

    def _run(self, function: Callable[..., Any], arguments: tuple[Any, ...], keep: object) -> Any:
        try:  # ``keep`` is referenced by this frame until the call returns
            return function(*arguments)
        finally:
            self._free.release()

    def failed(self, action: str, codes: list[int]) -> StoreError:
        """The error a batch whose every answer was a failure raises: full, a timeout, or unavailable."""
        code = next((code for code in codes if code < 0), 0)
        kind = StoreFullError if code in FULL else StoreTimeoutError if code == RPC_TIMEOUT else StoreError
        return kind(f"{self.settings.url}: cannot {action}: Mooncake answered {code} "
                    f"({len(codes)} value(s))")

    def close(self) -> None:
        """Leave the pool (the segment this client lent goes with it, and the entries it held). Mooncake's close
        takes about 2 s (it stops its heartbeat) and holds the interpreter's lock meanwhile, so no thread of
        ours could wait for it any less: it is called as it is, once."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        self._workers.shutdown(wait=False)
        if store is not None:
            try:
                store.close()
            except Exception as error:
                logger.debug("Mooncake store %s: close failed: %s", self.settings.url, error)
