"""The Redis tier's data path: GET, GETRANGE and SET of large values in the server's protocol, by hand.

redis-py turns every reply into a new ``bytes`` through its parser, which moves a MiB value at a
third of the speed the server sends it. These functions speak RESP directly on a connection that
redis-py opened (it did the connecting, TLS, AUTH, SELECT and the protocol version: bulk strings,
errors and OK read alike in RESP2 and RESP3), reading a value straight into one
buffer with ``recv_into`` and sending one without joining it to the command. The connection must
be idle (no reply pending) and is unusable after any exception: the caller disconnects it.
"""

from __future__ import annotations

import socket
from typing import Any

# Reply headers are a few bytes; the first read also takes the start of a value (small values whole).
_FIRST_READ = 64 << 10


class RespError(Exception):
    """The server answered with an error (``-MOVED``, ``-OOM``, ``-NOAUTH`` ...): ``message`` says which."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


def _socket(connection: Any) -> socket.socket:
    if connection._sock is None:
        connection.connect()
    sock: socket.socket = connection._sock
    return sock


def _read_bulk(sock: socket.socket, into: memoryview | None) -> bytearray | memoryview | None:
    """One bulk-string reply: into ``into`` (which must be large enough) or a new buffer; None for nil."""
    head = sock.recv(_FIRST_READ)
    while b"\r\n" not in head:
        more = sock.recv(_FIRST_READ)
        if not more:
            raise ConnectionError("the server closed the connection mid-reply")
        head += more
    end = head.index(b"\r\n")
    kind, header = head[:1], head[1:end]
    if kind == b"-":
        raise RespError(header.decode("utf-8", "replace"))
    if kind == b"_":  # RESP3's null (redis-py speaks RESP3 where the server does)
        return None
    if kind != b"$":
        raise ConnectionError(f"unexpected reply {head[:32]!r} to a read")
    length = int(header)
    if length < 0:
        return None
    view = into[:length] if into is not None else memoryview(bytearray(length))
    body = head[end + 2:end + 2 + length]
    got = len(body)
    view[:got] = body
    while got < length:
        received = sock.recv_into(view[got:], length - got)
        if not received:
            raise ConnectionError("the server closed the connection mid-value")
        got += received
    trailer = len(head) - (end + 2 + length)  # bytes of the final \r\n already read
    missing = 2 - max(0, trailer)
    while missing > 0:
        received = len(sock.recv(missing))
        if not received:
            raise ConnectionError("the server closed the connection mid-reply")
        missing -= received
    return view if into is not None else view.obj  # type: ignore[return-value]


def get(connection: Any, key: bytes) -> bytearray | None:
    """The value of ``key`` in a new buffer, None when absent."""
    sock = _socket(connection)
    sock.sendall(_command(b"GET", key))
    value = _read_bulk(sock, None)
    return None if value is None else value  # type: ignore[return-value]


def get_range(connection: Any, key: bytes, start: int, into: memoryview) -> int:
    """Bytes ``[start, start + len(into))`` of ``key`` into ``into``; how many there were (0 when absent
    or past the end)."""
    sock = _socket(connection)
    sock.sendall(_command(b"GETRANGE", key, b"%d" % start, b"%d" % (start + len(into) - 1)))
    value = _read_bulk(sock, into)
    return 0 if value is None else len(value)


def set_values(connection: Any, values: list[tuple[bytes, list[memoryview | bytes]]], ttl_seconds: int | None, *,
               wait_replicas: int = 0, wait_timeout_ms: int = 0) -> None:
    """``SET key value [EX ttl]`` for each ``(key, pieces)`` in order, pipelined: every command is sent,
    then every reply read. A value is its ``pieces`` one after the other, each sent as it is (never
    joined to the command or to each other). With ``wait_replicas``, a ``WAIT`` follows, and fewer
    replicas acknowledging the writes within ``wait_timeout_ms`` raise a ``NOREPLICAS`` :class:`RespError`
    (the values are on the master, not yet anywhere else). Raises the first error reply, after reading
    them all."""
    sock = _socket(connection)
    expiry = (b"EX", b"%d" % ttl_seconds) if ttl_seconds else ()
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in expiry)
    for key, pieces in values:
        length = sum(len(piece) if isinstance(piece, bytes) else piece.nbytes for piece in pieces)
        sock.sendall(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(expiry), len(key), key, length))
        for piece in pieces:
            sock.sendall(piece)
        sock.sendall(tail)
    expected = len(values)
    if wait_replicas:
        replicas, timeout = b"%d" % wait_replicas, b"%d" % max(wait_timeout_ms, 1)  # WAIT 0 ms waits forever
        sock.sendall(b"*3\r\n$4\r\nWAIT\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(replicas), replicas, len(timeout),
                                                                             timeout))
        expected += 1
    replies = b""
    while replies.count(b"\r\n") < expected:
        more = sock.recv(_FIRST_READ)
        if not more:
            raise ConnectionError("the server closed the connection mid-reply")
        replies += more
    lines = replies.split(b"\r\n")[:expected]
    for reply in lines[:len(values)]:
        if reply.startswith(b"-"):
            raise RespError(reply[1:].decode("utf-8", "replace"))
        if reply != b"+OK":
            raise ConnectionError(f"unexpected reply {reply[:32]!r} to SET")
    if wait_replicas:
        acknowledged = lines[-1]
        if acknowledged.startswith(b"-"):
            raise RespError(acknowledged[1:].decode("utf-8", "replace"))
        if not (acknowledged.startswith(b":") and acknowledged[1:].isdigit()):
            raise ConnectionError(f"unexpected reply {acknowledged[:32]!r} to WAIT")
        if int(acknowledged[1:]) < wait_replicas:
            raise RespError(f"NOREPLICAS {int(acknowledged[1:])} of the {wait_replicas} replica(s) asked for "
                            f"acknowledged the write within {wait_timeout_ms} ms")
