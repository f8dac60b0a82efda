"""``redis-cluster://host:port[,host:port...]/``: entries spread over a Valkey/Redis Cluster by key slot.

redis-py's cluster client knows the topology (which master holds which slot); values move on that
master's connections in the server's protocol (:class:`~kvgroups.store.backends.redis.store.RespStore`),
and lookups are grouped per master and pipelined. Each master fails alone: one that dies costs
the misses of its slots (its reads are misses, its writes dropped) and is left alone for a while.
Meanwhile the topology is read again in the background, at most every :data:`REFRESH_SECONDS`,
for as long as a key falls on a master left alone (a node may still describe the old topology
while a failover completes): once a replica has been promoted and a node says so, its slots are
served from it at once, without a restart and without waiting out the dead master's back-off.
Only when every master fails does an operation raise. A cluster refusing queries while a master
is down (``cluster-require-full-coverage yes``, the servers' default: ``CLUSTERDOWN``) is asked
again after a short while, not a full back-off: it answers as soon as the failover is done.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvgroups.store.backends.base import StoreError
from kvgroups.store.backends.health import Backoff, RateLimitedLog
from kvgroups.store.backends.redis.resp import RespError, get_ranges
from kvgroups.store.backends.redis.routes import SPREAD_BYTES, spread
from kvgroups.store.backends.redis.settings import RedisSettings
from kvgroups.store.backends.redis.store import PARALLEL_READS, RespStore, redis_module
from kvgroups.store.backends.redis.value_parts import SCAN_COUNT, SCAN_MATCH, head_name, key_of

# The topology is read again (in the background) at most this often while keys fall on a master left alone.
REFRESH_SECONDS = 0.25
# A master that answered CLUSTERDOWN (the cluster refusing queries during a failover) is left alone this long.
CLUSTER_DOWN_RETRY_SECONDS = 0.25


class _NodeDownError(Exception):
    """A master that is backed off: its keys are misses, its writes dropped."""


class RedisClusterStore(RespStore):
    """Entries on a Valkey or Redis Cluster."""

    tier_name = "redis-cluster"

    def __init__(self, settings: RedisSettings) -> None:
        super().__init__(settings)
        redis = redis_module()
        cluster: Any = importlib.import_module("redis.cluster")

        kwargs = settings.connection_kwargs()
        for name in ("host", "port", "db", "path"):
            kwargs.pop(name, None)
        # One retry of a command that met a cluster error (a moved slot, a failover), after at most
        # 20 ms: spelled out because redis-py's default wait has changed between versions.
        retry = importlib.import_module("redis.retry").Retry(
            importlib.import_module("redis.backoff").ExponentialWithJitterBackoff(base=0.01, cap=1.0), retries=1)
        self._client = cluster.RedisCluster(
            startup_nodes=[cluster.ClusterNode(host, port) for host, port in settings.nodes],
            require_full_coverage=False, retry=retry, max_connections=settings.max_connections,
            ssl=settings.tls, **kwargs)
        self._redis = redis
        # What a data-path job of one master can fail with: a miss for that job, never for the others.
        self._isolated: tuple[type[BaseException], ...] = (_NodeDownError, *self._errors)
        self._log = RateLimitedLog()
        self._health: dict[str, Backoff] = {}
        self._topology_lock = threading.Lock()
        self._refreshing = False
        self._refreshed_at = -float("inf")
        self._refusing: set[str] = set()  # masters whose last failure was refusing queries (CLUSTERDOWN)

    # --- which master, and whether it may be asked ----------------------------------------------------
    def _node(self, name: bytes) -> Any:
        try:
            node = self._client.get_node_from_key(name)
        except self._redis.exceptions.RedisClusterException as error:  # no master holds the slot now
            self._refresh_topology()
            raise _NodeDownError(str(error)) from None
        health = self._health.get(node.name)
        if health is not None and not health.available():
            self._refresh_topology()  # another master may hold its slots by now
            raise _NodeDownError(node.name)
        return node

    def _node_failed(self, node_name: str, error: BaseException) -> None:
        health = self._health.setdefault(node_name, Backoff(f"{self.url} master {node_name}", self._log))
        # A master refusing queries while the cluster is down is there, and answers once it is whole again;
        # one that no longer holds the slot (MOVED, ASK: failed over, resharded) is there too, and holds its
        # own slots: asked again once the topology is read again, not after a full back-off (5 s of misses
        # for every slot it holds, which outlasted failovers by seconds).
        reply = (error.message if isinstance(error, RespError) else str(error)) if isinstance(
            error, (RespError, self._redis.exceptions.ResponseError)) else ""
        refused = isinstance(error, self._redis.exceptions.ClusterDownError) or reply.startswith("CLUSTERDOWN")
        moved = isinstance(error, (self._redis.exceptions.MovedError, self._redis.exceptions.AskError)) or \
            reply.startswith(("MOVED", "ASK"))
        health.failed("reach", error, retry_after=CLUSTER_DOWN_RETRY_SECONDS if refused or moved else None)
        if refused or moved:  # there, answering: not a master that is gone
            self._refusing.add(node_name)
        else:
            self._refusing.discard(node_name)
        self.record_error(error)
        self._refresh_topology()

    def gauges(self) -> dict[str, float]:
        return {"backed_off_masters": float(sum(not health.available() for health in list(self._health.values())))}

    def _refresh_topology(self) -> None:
        """Read which master holds which slot again (a replica may have been promoted), in a thread of its
        own: a node may take its timeout to answer, and no lookup or value waits for that. At most one
        refresh runs, started at most every :data:`REFRESH_SECONDS`."""
        with self._topology_lock:
            now = time.monotonic()
            if self._refreshing or now - self._refreshed_at < REFRESH_SECONDS:
                return
            self._refreshing, self._refreshed_at = True, now
        threading.Thread(target=self._read_topology, name="kvgroups-cluster-topology", daemon=True).start()

    def _read_topology(self) -> None:
        try:
            self._client.nodes_manager.initialize()
        except (*self._errors, self._redis.exceptions.RedisClusterException):
            pass  # no node answered: the next key on a master left alone asks again
        finally:
            with self._topology_lock:
                self._refreshing = False

    def wait_for_topology(self, timeout: float = 10.0) -> bool:
        """Wait until no topology refresh runs (tests); whether none does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._topology_lock:
                if not self._refreshing:
                    return True
            time.sleep(0.01)
        return False

    def _connection_for(self, name: bytes) -> contextlib.AbstractContextManager[Any]:
        return self._connection_to(self._node(name))

    @contextlib.contextmanager
    def _connection_to(self, node: Any) -> Iterator[Any]:
        pool = self._client.get_redis_connection(node).connection_pool
        try:
            connection = pool.get_connection()  # connects: a master gone fails here, and is backed off too
        except (OSError, self._redis.exceptions.RedisError) as error:
            self._node_failed(node.name, error)
            raise
        try:
            yield connection
        except (RespError, OSError, self._redis.exceptions.RedisError) as error:
            connection.disconnect()
            # A refused value (OOM: full) is that value's; the master itself failed only when it could not
            # be reached or no longer holds the slot (resharded, failed over: the topology is read again).
            if not isinstance(error, RespError) or error.message.startswith(("MOVED", "ASK", "CLUSTERDOWN")):
                self._node_failed(node.name, error)
            raise
        finally:
            pool.release(connection)

    # --- the data path: a master that is down costs misses, not the others' hits -----------------------
    # A value is written on its master's connection, a batch's reads are pipelined on its masters' connections
    # (each master's share spread over a few: RespStore); a master that is down, or fails, reads nothing (its
    # keys are misses) or writes nothing (a value not saved: put_many raises once every value was tried,
    # without backing the others off), and the failure backs that master off (recorded by _connection_to).
    def _set(self, layout: list[tuple[bytes, list[memoryview | bytes]]]) -> str | None:
        try:
            return super()._set(layout)
        except self._isolated as error:
            return f"{type(error).__name__}: {error}"

    def _routes(self, names: list[bytes], sizes: list[int]) -> list[list[int]]:
        """Each master's reads (none of a master that is backed off: misses), spread over its connections."""
        by_node: dict[str, list[int]] = {}
        for index, name in enumerate(names):
            try:
                by_node.setdefault(self._node(name).name, []).append(index)
            except _NodeDownError:
                continue
        return [[indices[at] for at in run] for indices in by_node.values()
                for run in spread([sizes[index] for index in indices], PARALLEL_READS, SPREAD_BYTES)]

    def _read_on(self, reads: list[tuple[bytes, memoryview]]) -> list[int]:
        """Misses where the master is down, or failed mid-read, or answered a read with an error (the
        others' are read all the same); one that no longer holds the slot is backed off."""
        try:
            node = self._node(reads[0][0])
            with self._connection_to(node) as connection:
                replies = get_ranges(connection, reads)
        except self._isolated:
            return [0] * len(reads)
        moved = next((reply for reply in replies if isinstance(reply, RespError) and reply.message.startswith(
            ("MOVED", "ASK", "CLUSTERDOWN"))), None)
        if moved is not None:
            self._node_failed(node.name, moved)
        return [0 if isinstance(reply, RespError) else reply for reply in replies]

    # --- lookups, grouped per master ----------------------------------------------------------------
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        present = [False] * len(keys)
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for index, key in enumerate(keys):
            try:
                node = self._node(head_name(key))
            except _NodeDownError:
                self.note_unanswered()
                continue
            by_node.setdefault(node.name, (node, []))[1].append(index)
        for node_name, (node, indices) in by_node.items():
            try:
                with self._client.get_redis_connection(node).pipeline(transaction=False) as pipeline:
                    for index in indices:
                        pipeline.exists(head_name(keys[index]))
                    for index, found in zip(indices, pipeline.execute(), strict=True):
                        present[index] = bool(found)
            except self._errors as error:
                self.note_unanswered()
                self._node_failed(node_name, error)
        # A master down costs its keys' misses; only a cluster none of whose masters may be asked, or is there
        # at all, fails (a cluster refusing queries during a failover is there: misses until it is whole).
        if keys and not self._any_master_there():
            raise StoreError(f"{self.url}: cannot look up {len(keys)} keys: every master is down or backed off")
        return present

    def _any_master_there(self) -> bool:
        try:
            primaries = self._client.get_primaries()
        except self._redis.exceptions.RedisClusterException:
            return False
        return any(node.name not in self._health or self._health[node.name].available()
                   or node.name in self._refusing for node in primaries)

    def stats_by_master(self) -> dict[str, int]:
        """Values of kvgroups' held by each master (``host:port``)."""
        counts = {}
        for node in self._client.get_primaries():
            connection = self._client.get_redis_connection(node)
            counts[node.name] = sum(key_of(name.decode("utf-8")) is not None
                                    for name in connection.scan_iter(match=SCAN_MATCH, count=SCAN_COUNT))
        return counts

    def _scan(self) -> Iterator[str]:
        """Every master's server keys of kvgroups' (a replica's are its master's)."""
        try:
            for node in self._client.get_primaries():
                for name in self._client.get_redis_connection(node).scan_iter(match=SCAN_MATCH, count=SCAN_COUNT):
                    yield name.decode("utf-8")
        except self._errors as error:
            raise self._fail("SCAN", error) from error

    def _config_connection(self) -> Any:
        # The cluster client's CONFIG GET answers per node; every master of one cluster is set alike.
        return self._client.get_redis_connection(self._client.get_random_node())
