"""The Redis tier's batch reads, pipelined, on a real server and a real cluster.

Every read of a batch is asked before the first reply is read (a round trip per connection, not per
value); values of every size come back whole, cut at ``max_bytes + 1``, or as misses where a part is
gone; a value kvgroups did not write is its bytes (no decoder takes them); a key of another type is an
error the server answers mid-pipeline, after which the connection is still in step. On a cluster, a
master that is down costs its own keys only.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvgroups.core.sizes import KIB, MIB
from kvgroups.store import StoreError, open_store
from kvgroups.store.backends.redis import resp
from kvgroups.store.backends.redis.cluster import RedisClusterStore
from kvgroups.store.backends.redis.store import RedisStore
from kvgroups.store.backends.redis.value_parts import head_name, part_name
from tests.support.servers import Server, running_cluster, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("pipeline-redis")) as started:
        yield started


@pytest.fixture
def store(server: Server) -> Iterator[RedisStore]:
    opened = open_store(server.url)
    assert isinstance(opened, RedisStore)
    opened.clear()
    yield opened
    opened.close()


def pattern(seed: int, size: int) -> bytes:
    return (bytes(range(seed % 7, 251)) * (size // 200 + 1))[:size]


SIZES = {"small": 100, "tiny": 1, "64k": 64 * KIB, "1mib": MIB, "1mib+1": MIB + 1, "multi": 2 * MIB + 12345}


def test_a_batch_of_mixed_sizes_reads_back_whole(store: RedisStore) -> None:
    values = {name: pattern(index, size) for index, (name, size) in enumerate(SIZES.items())}
    store.put_many(list(values.items()))
    names = ["nothing", *values, "nothing either"]
    got = store.get_many(names)
    assert [None if value is None else bytes(value) for value in got] == [None, *values.values(), None]
    # max_bytes as the chunk store passes it (its largest entry): every value whole, or cut at max_bytes + 1.
    for limit in (0, 99, 64 * KIB, MIB, MIB + 1, 3 * MIB):
        cut = store.get_many(names, max_bytes=limit)
        assert [None if value is None else bytes(value) for value in cut] == \
            [None, *(value[:limit + 1] for value in values.values()), None], limit


def test_a_missing_part_and_a_foreign_value_cost_their_own_key_only(store: RedisStore, server: Server) -> None:
    store.put_many([("whole", pattern(1, 3 * MIB)), ("holed", pattern(2, 3 * MIB)), ("small", b"abc")])
    client = redis.Redis(port=server.port)
    client.delete(part_name("holed", 1))  # evicted while its head stayed
    client.set(head_name("foreign"), b"not a kvgroups value")
    client.set(head_name("foreign-large"), pattern(3, 2 * MIB))
    got = store.get_many(["whole", "holed", "foreign", "small", "foreign-large"])
    assert bytes(got[0]) == pattern(1, 3 * MIB) and got[1] is None  # type: ignore[arg-type]
    assert got[2] == b"not a kvgroups value" and bytes(got[3]) == b"abc"  # type: ignore[arg-type]
    assert got[4] is not None and pattern(3, 2 * MIB).startswith(bytes(got[4]))
    # As much of it as a head's buffer holds (the header's 32 bytes and max_bytes + 1): never all of it.
    assert store.get_many(["foreign-large"], max_bytes=10) == [pattern(3, 32 + 11)]
    client.close()


def test_an_error_reply_mid_pipeline_leaves_the_connection_in_step(store: RedisStore, server: Server) -> None:
    store.put_many([("a", pattern(1, 5000)), ("b", pattern(2, MIB + 7))])
    client = redis.Redis(port=server.port)
    client.rpush(head_name("a list"), b"x")  # not a string: GETRANGE answers WRONGTYPE
    with pytest.raises(StoreError, match="WRONGTYPE"):
        store.get_many(["a", "a list", "b"])
    # Every reply was read: the same connection answers the next batch in step.
    got = store.get_many(["a", "b"])
    assert [bytes(value) for value in got] == [pattern(1, 5000), pattern(2, MIB + 7)]  # type: ignore[arg-type]
    from kvgroups.store.backends.redis.resp import RespError, get_ranges

    connection = store._pool.get_connection()
    try:
        buffers = [bytearray(64) for _ in range(3)]
        replies = get_ranges(connection, [(head_name(name), memoryview(buffer))
                                          for name, buffer in zip(["a", "a list", "b"], buffers, strict=True)])
        assert replies[0] == replies[2] == 64 and isinstance(replies[1], RespError)
        assert connection.send_command("PING") is None and connection.read_response() in (b"PONG", "PONG")
    finally:
        store._pool.release(connection)
    client.close()


class Recording:
    """A connection's socket, recording what goes over it (shared by every connection's recorder)."""

    def __init__(self, sock: socket.socket, events: list[tuple[int, str, int]]) -> None:
        self._sock, self._events = sock, events

    def sendall(self, data: Any) -> None:
        self._events.append((id(self._sock), "send", bytes(data).count(b"GETRANGE")))
        self._sock.sendall(data)

    def recv_into(self, *arguments: Any) -> int:
        self._events.append((id(self._sock), "recv", 0))
        return self._sock.recv_into(*arguments)

    def recv(self, *arguments: Any) -> bytes:
        self._events.append((id(self._sock), "recv", 0))
        return self._sock.recv(*arguments)


def test_a_batch_is_asked_whole_before_its_first_reply_is_read(store: RedisStore,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [f"k{index}" for index in range(24)]
    store.put_many([(key, pattern(index, 40 * KIB + index)) for index, key in enumerate(keys)] +
                   [("big", pattern(9, 5 * MIB))])
    events: list[tuple[int, str, int]] = []
    lock = threading.Lock()
    real_socket = resp._socket

    def recorded(connection: Any) -> Any:
        with lock:
            return Recording(real_socket(connection), events)

    monkeypatch.setattr(resp, "_socket", recorded)
    got = store.get_many([*keys, "big"], max_bytes=5 * MIB)
    assert [bytes(value) for value in got] == [*(pattern(index, 40 * KIB + index) for index in range(24)),  # type: ignore[arg-type]
                                              pattern(9, 5 * MIB)]
    # 25 heads, then big's 4 other parts: a send per connection per round (the old reads sent one per key).
    sends = [commands for _, what, commands in events if what == "send"]
    assert sum(sends) == 25 + 4 and len(sends) <= 2 * 4, sends
    first = {sock: what for sock, what, _ in reversed(events)}
    assert set(first.values()) == {"send"}  # on every connection, the commands went before any reply was read


def test_a_cluster_master_down_costs_its_keys_only(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "cluster", replicas=0) as cluster:
        store = open_store(cluster.url)
        assert isinstance(store, RedisClusterStore)
        keys = [f"c{index}" for index in range(30)]
        values = {key: pattern(index, (index % 3) * MIB + 1000 * index + 1) for index, key in enumerate(keys)}
        store.put_many(list(values.items()))
        got = store.get_many(keys)
        assert [bytes(value) for value in got] == list(values.values())  # type: ignore[arg-type]
        port_of = {key: int(store._client.get_node_from_key(head_name(key)).port) for key in keys}
        victim = port_of[keys[0]]
        # A key of another type on a master that stays up: only that key misses.
        listy = next(name for name in (f"listy{index}" for index in range(100))
                     if int(store._client.get_node_from_key(head_name(name)).port) != victim)
        client = redis.Redis(port=int(store._client.get_node_from_key(head_name(listy)).port))
        client.rpush(head_name(listy), b"x")
        client.close()
        cluster.kill(victim)
        for _ in range(2):  # the second after the dead master was backed off (not asked again)
            got = store.get_many([*keys, listy])
            assert got[-1] is None
            for key, value in zip(keys, got[:-1], strict=True):
                if port_of[key] == victim:
                    assert value is None, key
                else:
                    assert value is not None and bytes(value) == values[key], key
        # Reads alone (no lookup) back the dead master off: its connection refused, it is asked no more.
        assert store.gauges()["backed_off_masters"] == 1
        store.close()
