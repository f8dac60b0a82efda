"""Stored entries: one group's chunk tensor as a safetensors blob that says what it is, with a checksum.

An entry's safetensors metadata names its format, its key, the metadata fingerprint, the group and
chunk index, dtype and shape, and an xxh3-64 checksum of all of that and the tensor bytes (so a
changed header field is caught even by a reader that does not know what to expect). :func:`decode_entry`
serves a value only when all of that is what the caller asked for and the checksum holds; every
mismatch is listed in one :class:`CorruptEntryError`. No pickle anywhere: safetensors stores raw
bytes and a JSON header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
import xxhash

from kvgroups.core.dtypes import dtype_from_name, dtype_name
from kvgroups.errors import KVGroupsError

ENTRY_FORMAT = "kvgroups.entry/1"
TENSOR_NAME = "kv"
_HEADER_LENGTH = struct.Struct("<Q")
# An entry header (JSON) is a few hundred bytes; refuse to parse anything absurd.
MAX_HEADER_BYTES = 1 << 20


class CorruptEntryError(KVGroupsError):
    """A stored value is not the entry it was asked as (or not an entry at all)."""


@dataclass(frozen=True, kw_only=True)
class EntryInfo:
    """What an entry is: a value is served only as exactly this."""

    key: str
    fingerprint: str
    group_index: int
    chunk_index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, str]:
        return {
            "format": ENTRY_FORMAT, "key": self.key, "fingerprint": self.fingerprint,
            "group": str(self.group_index), "chunk": str(self.chunk_index), "dtype": dtype_name(self.dtype),
            "shape": json.dumps(list(self.shape)),
        }


def _checksum(metadata: dict[str, str], tensor: torch.Tensor) -> str:
    """xxh3-64 of the metadata (every field but the checksum, canonical JSON) and the tensor's bytes."""
    digest = xxhash.xxh3_64()
    fields = {name: value for name, value in metadata.items() if name != "checksum"}
    digest.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def encode_entry(tensor: torch.Tensor, info: EntryInfo) -> bytes:
    """The stored bytes of ``tensor`` as the entry ``info``; raises when the tensor is not what ``info`` says."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"an entry holds a tensor, got {type(tensor).__name__}")
    problems = []
    if tensor.dtype != info.dtype:
        problems.append(f"dtype {tensor.dtype} (expected {info.dtype})")
    if tuple(tensor.shape) != tuple(info.shape):
        problems.append(f"shape {list(tensor.shape)} (expected {list(info.shape)})")
    if problems:
        raise KVGroupsError(f"entry {info.key!r} (group {info.group_index}, chunk {info.chunk_index}): tensor has "
                            + ", ".join(problems))
    data = tensor.detach().to("cpu").contiguous()
    metadata = info.metadata()
    metadata["checksum"] = _checksum(metadata, data)
    return safetensors.torch.save({TENSOR_NAME: data}, metadata=metadata)


def read_header(data: bytes | memoryview) -> dict[str, Any]:
    """The safetensors JSON header of a stored value; raises :class:`CorruptEntryError` when there is none."""
    view = memoryview(data)
    if len(view) < _HEADER_LENGTH.size:
        raise CorruptEntryError(f"value of {len(view)} bytes is too short to be an entry")
    (length,) = _HEADER_LENGTH.unpack_from(view)
    if length > min(MAX_HEADER_BYTES, len(view) - _HEADER_LENGTH.size):
        raise CorruptEntryError(f"header length {length} does not fit a value of {len(view)} bytes")
    try:
        header = json.loads(bytes(view[_HEADER_LENGTH.size:_HEADER_LENGTH.size + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptEntryError(f"entry header is not JSON: {error}") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptEntryError("entry header has no metadata")
    return header


def decode_entry(data: bytes, expected: EntryInfo | None = None) -> torch.Tensor:
    """The tensor of a stored value, when it is ``expected`` (or, without one, consistent in itself).

    Raises :class:`CorruptEntryError` listing every field that differs, a checksum that fails, or
    a value that is no entry.
    """
    header = read_header(data)
    metadata: dict[str, str] = header["__metadata__"]
    problems = []
    if metadata.get("format") != ENTRY_FORMAT:
        problems.append(f"format {metadata.get('format')!r} (expected {ENTRY_FORMAT!r})")
    if expected is not None:
        for field, value in expected.metadata().items():
            if field != "format" and metadata.get(field) != value:
                problems.append(f"{field} {metadata.get(field)!r} (expected {value!r})")
    if problems:
        raise CorruptEntryError("entry is not what was asked for: " + ", ".join(problems))
    try:
        tensor = safetensors.torch.load(data)[TENSOR_NAME]
    except (KeyError, ValueError, RuntimeError, OSError) as error:
        raise CorruptEntryError(f"entry does not load as safetensors: {error}") from None
    try:
        described = (dtype_from_name(metadata["dtype"]), json.loads(metadata["shape"]))
    except (KeyError, ValueError, TypeError) as error:
        raise CorruptEntryError(f"entry metadata lacks or garbles dtype/shape: {error}") from None
    if (tensor.dtype, list(tensor.shape)) != described:
        raise CorruptEntryError(f"entry holds {tensor.dtype} {list(tensor.shape)} but says {described}")
    if metadata.get("checksum") != _checksum(metadata, tensor):
        raise CorruptEntryError(f"entry checksum {metadata.get('checksum')!r} does not match its header and bytes")
    return tensor
