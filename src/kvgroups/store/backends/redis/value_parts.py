"""How a value is laid out on a Valkey/Redis server: in parts of a size the server moves at full speed.

A server writes a large reply to one client in small pieces per turn of its event loop, and
allocates a large value in one piece: a 16 MiB value moves at half the rate of a 1 MiB one, with
the server's own client too. So a value is kept as parts of :data:`PART_BYTES`:

- the head key ``kvgroups:{KEY}`` holds a 32-byte header (magic, total length, part size) and the
  first part; a value of one part is that key alone (one round trip);
- parts 1.. are ``kvgroups:{KEY}#I``. The braces make every part hash to the head's slot (one
  master of a cluster holds a whole value, and one connection writes it in order).

Parts are written first and the head last, on one connection, so a head is never read before its
parts exist; a part missing later (evicted, expired) makes the value a miss. A value written again
replaces its parts in place (the server reuses their memory). Two writers of one key at once can
leave a mix of their parts: the entry's checksum or MAC then fails and the reader counts a corrupt
entry (a miss), never a wrong value.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvgroups.core.sizes import MIB

KEY_PREFIX = "kvgroups:"
# Every server key of kvgroups' (heads, parts, and what an older version wrote), as SCAN matches them, and
# how many keys a SCAN step asks for.
SCAN_MATCH, SCAN_COUNT = KEY_PREFIX + "*", 1000
PART_BYTES = 1 * MIB
_MAGIC = b"KVGPARTS"
_HEADER = struct.Struct("<8sQI")  # magic, total length, part size
HEADER_BYTES = 32
_PAD = HEADER_BYTES - _HEADER.size


@dataclass(frozen=True)
class Header:
    length: int
    part_bytes: int

    @property
    def num_parts(self) -> int:
        return max(1, -(-self.length // self.part_bytes))

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.length, self.part_bytes) + bytes(_PAD)

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Header | None:
        """The header at the start of a head value; None for a value that is not one (a corrupt or
        foreign value: a miss)."""
        if len(data) < HEADER_BYTES:
            return None
        magic, length, part_bytes = _HEADER.unpack_from(data)
        if magic != _MAGIC or part_bytes < 1:
            return None
        return cls(length, part_bytes)


def head_name(key: str) -> bytes:
    return f"{KEY_PREFIX}{{{key}}}".encode()


def part_name(key: str, index: int) -> bytes:
    return f"{KEY_PREFIX}{{{key}}}#{index}".encode()


def key_of(name: str) -> str | None:
    """The store key a server key names, None for a part (or a key that is not kvgroups')."""
    if not name.startswith(KEY_PREFIX + "{") or not name.endswith("}"):
        return None
    return name[len(KEY_PREFIX) + 1:-1]


def split(key: str, value: memoryview) -> list[tuple[bytes, list[memoryview | bytes]]]:
    """The server keys and values that store ``value``: parts 1.. first, the head last."""
    header = Header(value.nbytes, PART_BYTES)
    size = header.part_bytes
    parts: list[tuple[bytes, list[memoryview | bytes]]] = [
        (part_name(key, index), [value[index * size:(index + 1) * size]]) for index in range(1, header.num_parts)]
    return [*parts, (head_name(key), [header.pack(), value[:size]])]
