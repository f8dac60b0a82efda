"""``redis://``, ``rediss://``, ``unix://``: Valkey or Redis, shared by every engine on every node.

One server key per entry, under a prefix of kvgroups' own (so that ``clear`` and ``stats`` touch
nothing else on a shared server), with an optional TTL. Batch forms are pipelined. Connections come
from a blocking pool sized for the threads that use it; timeouts are short: a server that is down
or hung must cost a request a miss, not seconds. redis-py (which speaks to both Valkey and Redis)
is imported when such a store is opened. The URL's options: :mod:`kvgroups.store.redis_settings`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvgroups.core.sizes import MIB
from kvgroups.store.base import ByteStore, EntryTooLargeError, StoreError, StoreTimeoutError, Value, check_value
from kvgroups.store.redis_settings import RedisSettings

KEY_PREFIX = "kvgroups:"
# What a server accepts when it does not say (Redis' and Valkey's default proto-max-bulk-len).
_DEFAULT_MAX_VALUE_BYTES = 512 * MIB


class RedisStore(ByteStore):
    """Entries on a Valkey or Redis server through a redis-py client."""

    shared = True

    def __init__(self, settings: RedisSettings) -> None:
        try:
            import redis  # noqa: PLC0415 - an optional extra, loaded only for this tier
        except ImportError as error:
            raise StoreError(f"{settings.url} needs the redis client: pip install 'kvgroups[redis]' ({error})") \
                from error
        self.settings = settings
        self.url = settings.url  # masked: never holds the password
        self.ttl_seconds = settings.ttl_seconds
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._timeouts: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
        connection_class = (redis.UnixDomainSocketConnection if settings.unix_path is not None
                            else redis.SSLConnection if settings.tls else redis.Connection)
        # Threads beyond max_connections wait for a free connection (up to the timeout) instead of failing.
        self._pool = redis.BlockingConnectionPool(  # type: ignore[no-untyped-call]
            max_connections=settings.max_connections, timeout=settings.timeout_seconds,
            connection_class=connection_class, **settings.connection_kwargs())
        self._client = redis.Redis(connection_pool=self._pool)
        self._max_value_bytes: int | None = None

    def _fail(self, action: str, error: BaseException) -> StoreError:
        # A pool that stays exhausted for the whole timeout is a timeout too (a hung server holds its connections).
        timed_out = isinstance(error, self._timeouts) or "No connection available" in str(error)
        kind = StoreTimeoutError if timed_out else StoreError
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

    def _checked(self, key: str, value: Value) -> Value:
        value = check_value(key, value)
        if memoryview(value).nbytes > self._limit():
            raise EntryTooLargeError(
                f"value of {memoryview(value).nbytes} bytes for {key!r} exceeds the server's proto-max-bulk-len of "
                f"{self._limit()} bytes ({self.url})"
            )
        return value

    def put(self, key: str, value: Value) -> None:
        value = self._checked(key, value)
        try:
            self._client.set(KEY_PREFIX + key, value, ex=self.ttl_seconds)
        except self._errors as error:
            raise self._fail(f"SET {key!r}", error) from error

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        checked = [(key, self._checked(key, value)) for key, value in items]
        try:
            with self._client.pipeline(transaction=False) as pipeline:
                for key, value in checked:
                    pipeline.set(KEY_PREFIX + key, value, ex=self.ttl_seconds)
                pipeline.execute()
        except self._errors as error:
            raise self._fail(f"SET {len(checked)} keys", error) from error

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        return self.get_many([key], max_bytes)[0]

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[bytes | None]:
        if not keys:
            return []
        names = [KEY_PREFIX + key for key in keys]
        try:
            if max_bytes is None:
                values: Any = self._client.mget(names)
                return [None if value is None else bytes(value) for value in values]
            # At most max_bytes + 1 bytes of each: a value longer than any entry is never read whole.
            with self._client.pipeline(transaction=False) as pipeline:
                for name in names:
                    pipeline.exists(name)
                    pipeline.getrange(name, 0, max_bytes)
                replies = pipeline.execute()
        except self._errors as error:
            raise self._fail(f"GET {len(keys)} keys", error) from error
        return [bytes(value) if exists else None for exists, value in zip(replies[::2], replies[1::2], strict=True)]

    def get_prefix(self, key: str, num_bytes: int) -> bytes | None:
        try:
            with self._client.pipeline(transaction=False) as pipeline:
                pipeline.exists(KEY_PREFIX + key)
                pipeline.getrange(KEY_PREFIX + key, 0, num_bytes - 1)
                exists, prefix = pipeline.execute()
        except self._errors as error:
            raise self._fail(f"GETRANGE {key!r}", error) from error
        return prefix if exists else None

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
        self._client.close()
        self._pool.disconnect()
