"""The Redis tier's data path: GET, GETRANGE and SET of large values in the server's protocol, by hand.

redis-py turns every reply into a new ``bytes`` through its parser, which moves a MiB value at a
third of the speed the server sends it. These functions speak RESP directly on a connection that
redis-py opened (it did the connecting, TLS, AUTH, SELECT and the protocol version: bulk strings,
errors and OK read alike in RESP2 and RESP3), sending a value without joining it to the command.
Commands are pipelined (every one sent, then every reply read): :class:`Replies` reads the replies
of one connection in order, each value into its own buffer (the rest of a large one straight from
the socket with ``recv_into``), keeping what a read took of the next reply for it. The connection
must be idle (no reply pending) and is unusable after any exception (the caller disconnects it);
error replies :func:`get_ranges` answers leave it in step.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

# What one read off a connection takes at most: reply headers, and small values several at a time (below
# glibc's mmap threshold: a reader's buffer comes from the heap, not new pages).
_READ_BYTES = 64 << 10
# The rest of a value longer than this goes from the socket straight into its buffer, not through the reader's.
_DIRECT_BYTES = 64 << 10
# Bytes of replies a connection has asked for and not read yet, at most (a GETRANGE asks for its buffer's size):
# a server holds every reply it has not sent yet in memory of its own, which counts against its maxmemory.
PIPELINE_BYTES = 64 << 20


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


class Replies:
    """The replies on one connection, read in order. A read off the socket may take the start of the
    replies after the one asked for: those bytes are held here for the next. One instance per use of a
    connection (the connection is idle again once every reply asked for was read)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray(_READ_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # the bytes held: _buffer[_start:_end]

    def _receive(self) -> None:
        """More bytes after those held (moved to the front first: only ever part of a line)."""
        held = self._end - self._start
        if held == len(self._buffer):
            raise ConnectionError(f"a reply line longer than {len(self._buffer)} bytes")
        if self._start:
            self._buffer[:held] = bytes(self._view[self._start:self._end])
            self._start, self._end = 0, held
        received = self._sock.recv_into(self._view[held:])
        if not received:
            raise ConnectionError("the server closed the connection mid-reply")
        self._end += received

    def line(self) -> bytes:
        """The next line (a simple reply: ``+OK``, ``:3``, ``-ERR ...``; or a reply's header), without its CRLF."""
        while (at := self._buffer.find(b"\r\n", self._start, self._end)) < 0:
            self._receive()
        line = bytes(self._view[self._start:at])
        self._start = at + 2
        return line

    def _read_into(self, view: memoryview) -> None:
        got, length = 0, view.nbytes
        while got < length:
            if self._start < self._end:
                take = min(self._end - self._start, length - got)
                view[got:got + take] = self._view[self._start:self._start + take]
                self._start += take
                got += take
            elif length - got > _DIRECT_BYTES:
                received = self._sock.recv_into(view[got:], length - got)
                if not received:
                    raise ConnectionError("the server closed the connection mid-value")
                got += received
            else:
                self._receive()

    def _skip_crlf(self) -> None:
        while self._end - self._start < 2:
            self._receive()
        if not self._buffer.startswith(b"\r\n", self._start):
            raise ConnectionError("a bulk reply not followed by CRLF")
        self._start += 2

    def bulk(self, into: memoryview | None) -> bytearray | memoryview | None:
        """The next reply, a bulk string: into the start of ``into`` (a longer one is refused) or a new buffer;
        None for nil (RESP2's ``$-1``, RESP3's ``_``). An error reply raises :class:`RespError` once it was
        read whole (the replies after it can still be read); anything else, ConnectionError (the connection
        is then unusable)."""
        line = self.line()
        kind = line[:1]
        if kind == b"-":
            raise RespError(line[1:].decode("utf-8", "replace"))
        if kind == b"_":
            return None
        if kind not in (b"$", b"!") or not line[1:].lstrip(b"-").isdigit():
            raise ConnectionError(f"unexpected reply {line[:32]!r} to a read")
        length = int(line[1:])
        if length < 0:
            return None
        if kind == b"!":  # RESP3's bulk error
            message = memoryview(bytearray(length))
            self._read_into(message)
            self._skip_crlf()
            raise RespError(bytes(message).decode("utf-8", "replace"))
        if into is not None and length > into.nbytes:
            raise ConnectionError(f"a reply of {length} bytes to a read of at most {into.nbytes}")
        view = into[:length] if into is not None else memoryview(bytearray(length))
        self._read_into(view)
        self._skip_crlf()
        return view if into is not None else view.obj  # type: ignore[return-value]


def get(connection: Any, key: bytes) -> bytearray | None:
    """The value of ``key`` in a new buffer, None when absent."""
    sock = _socket(connection)
    sock.sendall(_command(b"GET", key))
    value = Replies(sock).bulk(None)
    return None if value is None else value  # type: ignore[return-value]


def get_range(connection: Any, key: bytes, start: int, into: memoryview) -> int:
    """Bytes ``[start, start + len(into))`` of ``key`` into ``into``; how many there were (0 when absent
    or past the end)."""
    sock = _socket(connection)
    sock.sendall(_command(b"GETRANGE", key, b"%d" % start, b"%d" % (start + len(into) - 1)))
    value = Replies(sock).bulk(into)
    return 0 if value is None else len(value)


def get_ranges(connection: Any, reads: Sequence[tuple[bytes, memoryview]]) -> list[int | RespError]:
    """The start of each ``(key, into)``'s value into ``into`` (as much as fits; never empty), pipelined:
    every GETRANGE is sent, then every reply read, in order (at most :data:`PIPELINE_BYTES` asked for at a
    time: more are sent as replies are read). For each key, how many bytes it held (0 when absent), or the
    error the server answered for it (the replies after it are read all the same: the connection stays
    usable). ConnectionError or OSError when the connection fails: the caller disconnects it."""
    if any(into.nbytes == 0 for _, into in reads):
        raise ValueError("GETRANGE into an empty buffer")  # would ask for "0 -1": the whole value
    sock = _socket(connection)
    replies = Replies(sock)
    results: list[int | RespError] = []
    sent = asked = 0
    for index, (_, into) in enumerate(reads):
        commands = []
        while sent < len(reads) and (sent == index or asked + reads[sent][1].nbytes <= PIPELINE_BYTES):
            key, view = reads[sent]
            commands.append(_command(b"GETRANGE", key, b"0", b"%d" % (view.nbytes - 1)))
            asked += view.nbytes
            sent += 1
        if commands:
            sock.sendall(b"".join(commands))
        try:
            value = replies.bulk(into)
        except RespError as error:
            results.append(error)
        else:
            results.append(0 if value is None else len(value))
        asked -= into.nbytes
    return results


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
    replies = Replies(sock)
    lines = [replies.line() for _ in range(expected)]
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
