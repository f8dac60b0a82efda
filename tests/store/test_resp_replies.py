"""The Redis tier's reply reader, against a fake socket: pipelined replies of every kind, cut anywhere.

A server's replies reach a client in fragments of any size; whatever a read takes of the replies after
the one asked for must be kept for them. Each value lands in its own buffer, nil and error replies are
told apart (an error leaves the replies after it readable), and a reply that breaks the protocol, or a
connection that closes mid-reply, is a ConnectionError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import cycle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgroups.core.sizes import KIB, MIB
from kvgroups.store.backends.redis.resp import Replies, RespError, get_ranges, set_values


@dataclass
class FakeSocket:
    """Hands out ``stream`` in fragments of the sizes given (in turn), never more than asked; records sends."""

    stream: bytes
    fragments: list[int] = field(default_factory=lambda: [1 << 30])
    sent: bytearray = field(default_factory=bytearray)
    events: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._at = 0
        self._sizes = cycle(self.fragments)

    def recv_into(self, view: memoryview, nbytes: int = 0) -> int:
        self.events.append("recv")
        size = min(next(self._sizes), nbytes or len(view), len(view), len(self.stream) - self._at)
        view[:size] = self.stream[self._at:self._at + size]
        self._at += size
        return size

    def sendall(self, data: bytes) -> None:
        self.events.append("send")
        self.sent += data

    @property
    def left(self) -> int:
        return len(self.stream) - self._at


@dataclass
class FakeConnection:
    _sock: FakeSocket


def value(index: int, size: int) -> bytes:
    """``size`` bytes of a pattern of reply ``index``'s own."""
    pattern = bytes((index * 7 + offset) % 251 for offset in range(251))
    return (pattern * (size // 251 + 1))[:size]


# Each reply: (kind, size). "bulk" of size bytes; "nil2" ($-1), "nil3" (_), "error" (-ERR), "blob_error" (!).
SIZES = [0, 1, 5, 4 * KIB, 64 * KIB - 1, 64 * KIB, 64 * KIB + 1, 300 * KIB, MIB]
KINDS = st.one_of(st.tuples(st.just("bulk"), st.sampled_from(SIZES)),
                  st.tuples(st.sampled_from(["nil2", "nil3", "error", "blob_error"]), st.just(0)))


def encoded(index: int, kind: str, size: int) -> bytes:
    if kind == "bulk":
        return b"$%d\r\n%s\r\n" % (size, value(index, size))
    if kind == "nil2":
        return b"$-1\r\n"
    if kind == "nil3":
        return b"_\r\n"
    message = b"ERR number %d went wrong" % index
    return b"-%s\r\n" % message if kind == "error" else b"!%d\r\n%s\r\n" % (len(message), message)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies=st.lists(KINDS, min_size=1, max_size=8),
       fragments=st.lists(st.integers(1, 200 * KIB), min_size=1, max_size=6), trailing=st.booleans())
def test_pipelined_replies_cut_anywhere_each_land_in_their_own_buffer(replies: list[tuple[str, int]],
                                                                       fragments: list[int], trailing: bool) -> None:
    after = b"+OK\r\n" if trailing else b""  # a reply nobody asked for yet: left on the socket's side untouched
    sock = FakeSocket(b"".join(encoded(index, kind, size) for index, (kind, size) in enumerate(replies)) + after,
                      fragments)
    reader = Replies(sock)  # type: ignore[arg-type]
    for index, (kind, size) in enumerate(replies):
        into = memoryview(bytearray(MIB + 7))
        if kind in ("error", "blob_error"):
            with pytest.raises(RespError, match=f"ERR number {index} went wrong"):
                reader.bulk(into)
            continue
        got = reader.bulk(into)
        if kind != "bulk":
            assert got is None
            continue
        assert isinstance(got, memoryview) and got.obj is into.obj and bytes(got) == value(index, size)
        assert bytes(into[size:size + 7]) == bytes(7)  # nothing written past the value
    if trailing:
        assert reader.line() == b"+OK"
    assert sock.left == 0


def test_a_value_read_into_a_new_buffer_and_simple_replies() -> None:
    sock = FakeSocket(b"$5\r\nhello\r\n+OK\r\n:3\r\n-OOM full\r\n$-1\r\n", [3])
    reader = Replies(sock)  # type: ignore[arg-type]
    assert reader.bulk(None) == bytearray(b"hello")
    assert [reader.line() for _ in range(3)] == [b"+OK", b":3", b"-OOM full"]
    assert reader.bulk(None) is None


@pytest.mark.parametrize(("stream", "message"), [
    (b"$10\r\n0123456789\r\n", "a reply of 10 bytes to a read of at most 8"),
    (b"+OK\r\n", "unexpected reply"),
    (b"$x\r\n", "unexpected reply"),
    (b"$3\r\nabcXY", "not followed by CRLF"),
    (b"$7\r\nabc", "closed the connection mid-reply"),
    (b"$3\r\na", "closed the connection mid-reply"),
    (b"$", "closed the connection mid-reply"),
])
def test_what_breaks_the_protocol_is_a_connection_error(stream: bytes, message: str) -> None:
    with pytest.raises(ConnectionError, match=message):
        Replies(FakeSocket(stream, [2])).bulk(memoryview(bytearray(8)))  # type: ignore[arg-type]


def test_a_connection_closed_mid_way_through_a_large_value_is_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="closed the connection mid-value"):
        Replies(FakeSocket(b"$100000\r\nabc", [2])).bulk(None)  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(fragments=st.lists(st.integers(1, 100 * KIB), min_size=1, max_size=4))
def test_get_ranges_sends_every_command_first_and_answers_each_read(fragments: list[int]) -> None:
    sizes = [3, 0, 70 * KIB, -1, 5]  # -1: an error reply (a key of another type, say)
    stream = b"".join(b"-WRONGTYPE not a string\r\n" if size < 0 else b"$%d\r\n%s\r\n" % (size, value(index, size))
                      for index, size in enumerate(sizes))
    sock = FakeSocket(stream, fragments)
    buffers = [bytearray(100 * KIB) for _ in sizes]
    reads = [(b"key%d" % index, memoryview(buffer)) for index, buffer in enumerate(buffers)]
    results = get_ranges(FakeConnection(sock), reads)
    assert results[:3] == [3, 0, 70 * KIB] and results[4] == 5
    assert isinstance(results[3], RespError) and results[3].message.startswith("WRONGTYPE")
    for index, size in enumerate(sizes):
        if size > 0:
            assert bytes(buffers[index][:size]) == value(index, size)
    assert sock.events[0] == "send" and "send" not in sock.events[1:]  # every command, then every reply
    assert bytes(sock.sent).count(b"GETRANGE") == len(sizes) and sock.left == 0
    assert bytes(sock.sent).startswith(b"*4\r\n$8\r\nGETRANGE\r\n$4\r\nkey0\r\n$1\r\n0\r\n$6\r\n102399\r\n")


def test_get_ranges_asks_for_at_most_the_pipeline_window_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgroups.store.backends.redis import resp

    monkeypatch.setattr(resp, "PIPELINE_BYTES", 250)
    sock = FakeSocket(b"$1\r\na\r\n" * 5)
    reads = [(b"k%d" % index, memoryview(bytearray(100))) for index in range(5)]
    assert get_ranges(FakeConnection(sock), reads) == [1] * 5
    # Two reads fit the window: two asked, then one more after each reply read.
    assert sock.events[:2] == ["send", "recv"]
    assert bytes(sock.sent).count(b"GETRANGE") == 5


def test_set_values_reads_every_reply_and_raises_the_first_error() -> None:
    sock = FakeSocket(b"+OK\r\n-OOM command not allowed\r\n+OK\r\n", [4])
    with pytest.raises(RespError, match="OOM"):
        set_values(FakeConnection(sock), [(b"a", [b"1"]), (b"b", [b"2"]), (b"c", [b"3"])], None)
    assert sock.left == 0
    sock = FakeSocket(b"+OK\r\n:0\r\n")
    with pytest.raises(RespError, match="NOREPLICAS 0 of the 1"):
        set_values(FakeConnection(sock), [(b"a", [memoryview(b"1")])], 60, wait_replicas=1, wait_timeout_ms=5)
    assert b"EX\r\n$2\r\n60\r\n" in sock.sent and b"WAIT" in sock.sent
