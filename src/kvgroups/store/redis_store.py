"""``redis://``, ``rediss://``, ``unix://``: Valkey or Redis, shared by every engine on every node.

One server key per entry, under a prefix of kvgroups' own (so that ``clear`` and ``stats`` touch
nothing else on a shared server), with an optional TTL. Values move at the server's speed: in its
protocol by hand (:mod:`kvgroups.store.resp`), read straight into one buffer, a large one in
parts fetched at once over several connections (a server writes a large reply to one client in
small pieces per turn of its event loop). Lookups and housekeeping go through redis-py, pipelined.
Connections come from a blocking pool sized for the threads that use it; timeouts are short: a
server that is down or hung costs a miss, not seconds. :class:`RespStore` is what a single
server and a cluster (:mod:`kvgroups.store.redis_cluster`) share. redis-py is imported when such
a store is opened. The URL's options: :mod:`kvgroups.store.redis_settings`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvgroups.core.sizes import MIB
from kvgroups.store import resp
from kvgroups.store.base import (
    ByteStore,
    EntryTooLargeError,
    Stored,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
    Value,
    check_value,
)
from kvgroups.store.redis_settings import RedisSettings

KEY_PREFIX = "kvgroups:"
# What a server accepts when it does not say (Redis' and Valkey's default proto-max-bulk-len).
_DEFAULT_MAX_VALUE_BYTES = 512 * MIB
# Values read whole up to this size; larger ones in parts of it, over several connections at once.
PART_BYTES = 4 * MIB
PARALLEL_READS = 4


def redis_module() -> Any:
    try:
        import redis  # noqa: PLC0415 - an optional extra, loaded only for this tier
    except ImportError as error:
        raise StoreError(f"a Valkey/Redis store needs the redis client: pip install 'kvgroups[redis]' ({error})") \
            from error
    return redis


class RespStore(ByteStore):
    """Entries on Valkey/Redis: the data path in RESP on pooled connections, the rest through redis-py.

    A subclass says where a key lives (:meth:`_connection_for`) and which redis-py client answers
    everything else (``_client``).
    """

    shared = True
    _client: Any

    def __init__(self, settings: RedisSettings) -> None:
        redis = redis_module()
        self.settings = settings
        self.url = settings.url  # masked: never holds the password
        self.ttl_seconds = settings.ttl_seconds
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError, resp.RespError)
        self._timeouts: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
        self._max_value_bytes: int | None = None
        self._workers = ThreadPoolExecutor(PARALLEL_READS, thread_name_prefix="kvgroups-redis")

    @abc.abstractmethod
    def _connection_for(self, name: bytes) -> contextlib.AbstractContextManager[Any]:
        """An idle connection to the server holding ``name``, given back (or dropped, after an error) on exit."""

    def _fail(self, action: str, error: BaseException) -> StoreError:
        # A pool that stays exhausted for the whole timeout is a timeout too (a hung server holds its connections).
        timed_out = isinstance(error, self._timeouts) or "No connection available" in str(error)
        full = isinstance(error, resp.RespError) and error.message.startswith("OOM")
        kind = StoreTimeoutError if timed_out else StoreFullError if full else StoreError
        return kind(f"{self.url}: cannot {action}: {type(error).__name__}: {error}")

    def _limit(self) -> int:
        if self._max_value_bytes is None:
            try:
                reply: Any = self._client.config_get("proto-max-bulk-len")
                self._max_value_bytes = int(reply.get("proto-max-bulk-len", _DEFAULT_MAX_VALUE_BYTES))
            except self._errors:
                # Managed servers may refuse CONFIG; assume the default rather than guess larger.
                self._max_value_bytes = _DEFAULT_MAX_VALUE_BYTES
        return self._max_value_bytes

    def _checked(self, key: str, value: Value) -> memoryview:
        view = memoryview(check_value(key, value)).cast("B")
        if view.nbytes > self._limit():
            raise EntryTooLargeError(
                f"value of {view.nbytes} bytes for {key!r} exceeds the server's proto-max-bulk-len of "
                f"{self._limit()} bytes ({self.url})"
            )
        return view

    # --- the data path ------------------------------------------------------------------------
    def put(self, key: str, value: Value) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        checked = [((KEY_PREFIX + key).encode(), self._checked(key, value)) for key, value in items]
        self._run("SET", [(self._set, name, value) for name, value in checked])

    def _set(self, name: bytes, value: memoryview) -> None:
        with self._connection_for(name) as connection:
            resp.set_value(connection, name, value, self.ttl_seconds)

    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        return self.get_many([key], max_bytes)[0]

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[Stored | None]:
        names = [(KEY_PREFIX + key).encode() for key in keys]
        if max_bytes is None:  # whole values (inspection), one at a time
            return self._run("GET", [(self._get_whole, name) for name in names])
        # At most max_bytes + 1 bytes of each (a value longer than any entry is never read whole), in
        # parts of PART_BYTES, every part of every value fetched at once over the workers' connections.
        buffers = [bytearray(max_bytes + 1) for _ in names]
        views = [memoryview(buffer) for buffer in buffers]
        jobs = [(self._get_part, name, view, start)
                for name, view in zip(names, views, strict=True) for start in range(0, max_bytes + 1, PART_BYTES)]
        try:
            lengths = self._run("GET", jobs)
        finally:
            del jobs
            for view in views:
                view.release()  # so that each buffer can shrink to its value
        values: list[Stored | None] = []
        position = 0
        for buffer in buffers:
            parts = -(-(max_bytes + 1) // PART_BYTES)
            length = _contiguous(lengths[position:position + parts])
            position += parts
            del buffer[length:]  # shrinks in place
            values.append(buffer if length else None)  # an entry is never empty: empty is absent
        return values

    def _get_whole(self, name: bytes) -> bytearray | None:
        with self._connection_for(name) as connection:
            return resp.get(connection, name)

    def _get_part(self, name: bytes, buffer: memoryview, start: int) -> int:
        with self._connection_for(name) as connection:
            return resp.get_range(connection, name, start, buffer[start:start + PART_BYTES])

    def _run(self, action: str, jobs: list[tuple[Any, ...]]) -> list[Any]:
        """Each ``(function, *arguments)``: on this thread when there is one, else on the workers."""
        try:
            if len(jobs) == 1:
                function, *arguments = jobs[0]
                return [function(*arguments)]
            futures = [self._workers.submit(*job) for job in jobs]
            return [future.result() for future in futures]
        except self._errors as error:
            raise self._fail(f"{action} {len(jobs)} value(s)", error) from error

    def get_prefix(self, key: str, num_bytes: int) -> Stored | None:
        name = (KEY_PREFIX + key).encode()
        buffer = bytearray(num_bytes)
        length = self._run("GETRANGE", [(self._get_part_of, name, memoryview(buffer))])[0]
        return bytes(buffer[:length]) if length else None

    def _get_part_of(self, name: bytes, buffer: memoryview) -> int:
        with self._connection_for(name) as connection:
            return resp.get_range(connection, name, 0, buffer)

    # --- lookups and housekeeping (redis-py, pipelined) -------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        try:
            with self._client.pipeline(transaction=False) as pipeline:
                for key in keys:
                    pipeline.exists(KEY_PREFIX + key)
                return [bool(found) for found in pipeline.execute()]
        except self._errors as error:
            raise self._fail(f"EXISTS {len(keys)} keys", error) from error

    def delete(self, key: str) -> bool:
        try:
            return bool(self._client.delete(KEY_PREFIX + key))
        except self._errors as error:
            raise self._fail(f"DEL {key!r}", error) from error

    def size_of(self, key: str) -> int | None:
        try:
            with self._client.pipeline(transaction=False) as pipeline:
                pipeline.exists(KEY_PREFIX + key)
                pipeline.strlen(KEY_PREFIX + key)
                exists, length = pipeline.execute()
        except self._errors as error:
            raise self._fail(f"STRLEN {key!r}", error) from error
        return int(length) if exists else None

    def iter_keys(self) -> Iterator[str]:
        try:
            for name in self._client.scan_iter(match=KEY_PREFIX + "*", count=1000):
                yield name.decode("utf-8").removeprefix(KEY_PREFIX)
        except self._errors as error:
            raise self._fail("SCAN", error) from error

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        self._client.close()


def _contiguous(lengths: Sequence[int]) -> int:
    """The bytes the parts of one value hold, up to the first part the value did not fill."""
    total = 0
    for length in lengths:
        total += length
        if length < PART_BYTES:
            break
    return total


class RedisStore(RespStore):
    """Entries on one Valkey or Redis server."""

    def __init__(self, settings: RedisSettings) -> None:
        super().__init__(settings)
        redis = redis_module()
        connection_class = (redis.UnixDomainSocketConnection if settings.unix_path is not None
                            else redis.SSLConnection if settings.tls else redis.Connection)
        # Threads beyond max_connections wait for a free connection (up to the timeout) instead of failing.
        self._pool = redis.BlockingConnectionPool(
            max_connections=settings.max_connections, timeout=settings.timeout_seconds,
            connection_class=connection_class, **settings.connection_kwargs())
        self._client = redis.Redis(connection_pool=self._pool)

    @contextlib.contextmanager
    def _connection_for(self, name: bytes) -> Iterator[Any]:
        connection = self._pool.get_connection()
        try:
            yield connection
        except BaseException:
            connection.disconnect()  # mid-reply: its protocol state is unknown
            raise
        finally:
            self._pool.release(connection)

    def close(self) -> None:
        super().close()
        self._pool.disconnect()
