"""``redis://``, ``rediss://``, ``unix://``: Valkey or Redis, shared by every engine on every node.

One server key per entry, under a prefix of kvgroups' own (so that ``clear`` and ``stats`` touch
nothing else on a shared server), with an optional TTL. Values move at the server's speed: in its
protocol by hand (:mod:`kvgroups.store.backends.redis.resp`), read straight into one buffer, a large one in
parts fetched at once over several connections (a server writes a large reply to one client in
small pieces per turn of its event loop). Lookups and housekeeping go through redis-py, pipelined.
Connections come from a blocking pool sized for the threads that use it; timeouts are short: a
server that is down or hung costs a miss, not seconds. :class:`RespStore` is what a single
server and a cluster (:mod:`kvgroups.store.backends.redis.cluster`) share. redis-py is imported when such
a store is opened. The URL's options: :mod:`kvgroups.store.backends.redis.settings`.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvgroups.core.sizes import MIB
from kvgroups.store.backends.base import (
    ByteStore,
    EntryTooLargeError,
    Stored,
    StoreError,
    StoreFullError,
    StoreTimeoutError,
    UnacknowledgedWriteError,
    Value,
    check_value,
)
from kvgroups.store.backends.read_buffers import BufferPool
from kvgroups.store.backends.redis.resp import RespError, get_range, get_ranges, set_values
from kvgroups.store.backends.redis.routes import SPREAD_BYTES, spread
from kvgroups.store.backends.redis.settings import RedisSettings
from kvgroups.store.backends.redis.value_parts import (
    HEADER_BYTES,
    PART_BYTES,
    SCAN_COUNT,
    SCAN_MATCH,
    Header,
    head_name,
    key_of,
    part_name,
    split,
)

# The server's setting for the largest value it accepts, and what it is when a server does not say (Redis' and
# Valkey's default).
_MAX_VALUE_SETTING = "proto-max-bulk-len"
_DEFAULT_MAX_VALUE_BYTES = 512 * MIB
# Connections a store moves values over at once (parts of one value, or several values).
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
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError, RespError)
        self._timeouts: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
        self._max_value_bytes: int | None = None
        self._workers = ThreadPoolExecutor(PARALLEL_READS, thread_name_prefix="kvgroups-redis")
        self._buffers = BufferPool()  # what batches are read into, used again once their values are dropped

    @abc.abstractmethod
    def _connection_for(self, name: bytes) -> contextlib.AbstractContextManager[Any]:
        """An idle connection to the server holding ``name``, given back (or dropped, after an error) on exit."""

    def _fail(self, action: str, error: BaseException) -> StoreError:
        # A pool that stays exhausted for the whole timeout is a timeout too (a hung server holds its connections).
        timed_out = isinstance(error, self._timeouts) or "No connection available" in str(error)
        full = isinstance(error, RespError) and error.message.startswith("OOM")
        unacknowledged = isinstance(error, RespError) and error.message.startswith("NOREPLICAS")
        kind = StoreTimeoutError if timed_out else StoreFullError if full else \
            UnacknowledgedWriteError if unacknowledged else StoreError
        return kind(f"{self.url}: cannot {action}: {type(error).__name__}: {error}")

    def _config_connection(self) -> Any:
        """A connection to one server whose CONFIG answers for every server of this store."""
        return self._client

    def _limit(self) -> int:
        if self._max_value_bytes is None:
            # A reply that is not one number (a proxy's, a cluster node's odd answer) counts as no answer.
            unanswered: tuple[type[BaseException], ...] = (*self._errors, AttributeError, TypeError, ValueError)
            try:
                reply: Any = self._config_connection().config_get(_MAX_VALUE_SETTING)
                self._max_value_bytes = int(reply.get(_MAX_VALUE_SETTING, _DEFAULT_MAX_VALUE_BYTES))
            except unanswered:
                # Managed servers may refuse CONFIG; assume the default rather than guess larger.
                self._max_value_bytes = _DEFAULT_MAX_VALUE_BYTES
        return self._max_value_bytes

    def _checked(self, key: str, value: Value) -> memoryview:
        view = memoryview(check_value(key, value)).cast("B")
        if view.nbytes > self._limit():
            raise EntryTooLargeError(
                f"value of {view.nbytes} bytes for {key!r} exceeds the server's {_MAX_VALUE_SETTING} of "
                f"{self._limit()} bytes ({self.url})"
            )
        return view

    # --- the data path: values in parts (:mod:`kvgroups.store.backends.redis.value_parts`) ----------------------------
    def put(self, key: str, value: Value) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        """Write every value; raises when any is not saved as asked (with ``wait_replicas``: not
        acknowledged by that many replicas), after trying them all."""
        layouts = [split(key, self._checked(key, value)) for key, value in items]
        # One value on one connection (its parts, then its head, in order: a server reads one stream
        # as fast as a client sends it); several values at once over the workers.
        unsaved = [problem for problem in self._run("SET", [(self._set, layout) for layout in layouts]) if problem]
        if unsaved:
            raise UnacknowledgedWriteError(f"{self.url}: {len(unsaved)} of {len(layouts)} value(s) not saved: "
                                           f"{unsaved[0]}")

    def _set(self, layout: list[tuple[bytes, list[memoryview | bytes]]]) -> str | None:
        """Write one value on one connection; a subclass may answer why it was not saved instead of raising."""
        with self._connection_for(layout[-1][0]) as connection:
            set_values(connection, layout, self.ttl_seconds, wait_replicas=self.settings.wait_replicas,
                       wait_timeout_ms=round(self.settings.wait_timeout_seconds * 1000))
        return None

    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        return self.get_many([key], max_bytes)[0]

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[Stored | None]:
        """Heads first (the header and the first part, into the value's buffer), then every other part
        of every value, each round pipelined (:meth:`_read_ranges`); at most ``max_bytes + 1`` bytes of
        each (a value longer than any entry is never read whole)."""
        first = HEADER_BYTES + PART_BYTES
        capacity = HEADER_BYTES + (max_bytes + 1 if max_bytes is not None else PART_BYTES)
        size = max(capacity, first) if max_bytes is None else capacity
        whole = memoryview(self._buffers.take(size * len(keys)).data).cast("B")
        buffers = [whole[index * size:(index + 1) * size] for index in range(len(keys))]
        heads = self._read_ranges([(head_name(key), buffer, 0) for key, buffer in zip(keys, buffers, strict=True)])
        reads: list[tuple[bytes, memoryview, int]] = []
        wanted = []
        headers = [Header.unpack(buffer) if length else None for buffer, length in zip(buffers, heads, strict=True)]
        for index, (key, length, header) in enumerate(zip(keys, heads, headers, strict=True)):
            if header is None:  # absent; or not a value kvgroups wrote: its bytes, which no decoder takes
                wanted.append(0 if not length else -length)
                continue
            want = header.length if max_bytes is None else min(header.length, max_bytes + 1)
            if HEADER_BYTES + want > len(buffers[index]):  # a whole read (no max_bytes) of a value over a part
                grown = bytearray(HEADER_BYTES + want)
                grown[:length] = buffers[index][:length]
                buffers[index] = memoryview(grown)
            wanted.append(want)
            reads += [(part_name(key, part), buffers[index], HEADER_BYTES + part * header.part_bytes)
                      for part in range(1, -(-want // header.part_bytes))]
        lengths = dict(zip(((name, start) for name, _, start in reads), self._read_ranges(reads), strict=True))
        values: list[Stored | None] = []
        for index, (key, want) in enumerate(zip(keys, wanted, strict=True)):
            if want <= 0:
                values.append(bytes(buffers[index][:-want]) if want else None)
                continue
            header = headers[index]
            assert header is not None  # unpacked above
            parts = range(1, -(-want // header.part_bytes))
            expected = [min(header.part_bytes, want - part * header.part_bytes) for part in parts]
            got = [lengths[part_name(key, part), HEADER_BYTES + part * header.part_bytes]
                   for part in parts]
            # A part gone (evicted, expired) while its head stayed: the value is a miss.
            values.append(memoryview(buffers[index])[HEADER_BYTES:HEADER_BYTES + want] if got == expected else None)
        return values

    def _read_ranges(self, reads: list[tuple[bytes, memoryview, int]]) -> list[int]:
        """Each ``(name, buffer, start)``: server key ``name`` (a head: header and first part; or a part) into
        ``buffer`` from ``start``, as much as fits; how many bytes each held. Every read of a connection is
        asked before its first reply is read (a round trip per batch, not per value); the reads are spread
        over connections (:meth:`_routes`), which move them at once."""
        views = [memoryview(buffer)[start:start + (HEADER_BYTES + PART_BYTES if start == 0 else PART_BYTES)]
                 for _, buffer, start in reads]
        try:
            routes = self._routes([name for name, _, _ in reads], [view.nbytes for view in views])
            lengths = [0] * len(reads)
            got = self._run("GET", [(self._read_on, [(reads[index][0], views[index]) for index in route])
                                    for route in routes])
            for route, route_lengths in zip(routes, got, strict=True):
                for index, length in zip(route, route_lengths, strict=True):
                    lengths[index] = length
            return lengths
        finally:
            for view in views:
                view.release()

    def _routes(self, names: list[bytes], sizes: list[int]) -> list[list[int]]:
        """Which reads go on one connection (indices into ``names``), each connection's reads in order: on one
        server, runs of consecutive reads of about equal size (:func:`spread`)."""
        return [list(run) for run in spread(sizes, PARALLEL_READS, SPREAD_BYTES)]

    def _read_on(self, reads: list[tuple[bytes, memoryview]]) -> list[int]:
        """``reads`` on one connection (to the server holding the first name), pipelined (:func:`get_ranges`);
        raises the first error the server answered, once every reply was read."""
        with self._connection_for(reads[0][0]) as connection:
            replies = get_ranges(connection, reads)
        lengths = []
        for reply in replies:
            if isinstance(reply, RespError):
                raise reply
            lengths.append(reply)
        return lengths

    def _run(self, action: str, jobs: list[tuple[Any, ...]]) -> list[Any]:
        """Each ``(function, *arguments)``: on this thread when there is one, else on the workers."""
        try:
            if len(jobs) <= 1:
                return [function(*arguments) for function, *arguments in jobs]
            futures = [self._workers.submit(*job) for job in jobs]
            return [future.result() for future in futures]
        except self._errors as error:
            raise self._fail(f"{action} {len(jobs)} value(s)", error) from error

    def get_prefix(self, key: str, num_bytes: int) -> Stored | None:
        value = self.get(key, max(num_bytes - 1, 0))
        return None if value is None else bytes(value[:num_bytes])

    def _header(self, key: str) -> Header | None:
        buffer = bytearray(HEADER_BYTES)
        length = self._run("GET", [(self._get_range_of, head_name(key), buffer)])[0]
        return Header.unpack(buffer) if length == HEADER_BYTES else None

    def _get_range_of(self, name: bytes, buffer: bytearray) -> int:
        with self._connection_for(name) as connection:
            return get_range(connection, name, 0, memoryview(buffer))

    # --- lookups and housekeeping (redis-py, pipelined) -------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        try:
            with self._client.pipeline(transaction=False) as pipeline:
                for key in keys:
                    pipeline.exists(head_name(key))
                return [bool(found) for found in pipeline.execute()]
        except self._errors as error:
            raise self._fail(f"EXISTS {len(keys)} keys", error) from error

    def delete(self, key: str) -> bool:
        header = self._header(key)
        names = [head_name(key)]
        if header is not None:
            names += [part_name(key, part) for part in range(1, header.num_parts)]
        try:
            return bool(self._client.delete(names[0])) | bool(names[1:] and self._delete_names(names[1:]))
        except self._errors as error:
            raise self._fail(f"DEL {key!r}", error) from error

    def _delete_names(self, names: list[bytes]) -> int:
        return sum(int(self._client.delete(name)) for name in names)  # one slot each, any deployment

    def size_of(self, key: str) -> int | None:
        header = self._header(key)
        if header is not None:
            return header.length
        try:
            length = self._client.strlen(head_name(key))
        except self._errors as error:
            raise self._fail(f"STRLEN {key!r}", error) from error
        return int(length) or None

    def _scan(self) -> Iterator[str]:
        """Every server key of kvgroups' (heads, parts, and what an older version wrote)."""
        try:
            for name in self._client.scan_iter(match=SCAN_MATCH, count=SCAN_COUNT):
                yield name.decode("utf-8")
        except self._errors as error:
            raise self._fail("SCAN", error) from error

    def iter_keys(self) -> Iterator[str]:
        for name in self._scan():
            key = key_of(name)
            if key is not None:
                yield key

    def clear(self) -> int:
        """Delete every server key of kvgroups' (parts of replaced values too); how many values went."""
        names = list(self._scan())
        try:
            for name in names:
                self._client.delete(name)
        except self._errors as error:
            raise self._fail("DEL", error) from error
        return sum(key_of(name) is not None for name in names)

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        self._client.close()


class RedisStore(RespStore):
    """Entries on one Valkey or Redis server."""

    tier_name = "redis"

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
