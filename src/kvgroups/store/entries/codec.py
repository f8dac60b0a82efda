"""Stored entries: one group's chunk tensor as a safetensors blob that says what it is, checked on every read.

An entry is a safetensors file: 8 bytes of header length, a JSON header naming one tensor ``kv``
and a ``__metadata__`` of strings (format, key, metadata fingerprint, group, chunk, dtype, shape,
and ``written``: the Unix second it was written, for ``kvgroups store stats``), then the tensor's
bytes. Its integrity is one of three seals, named in the metadata:

- none (no secret): an xxh3-64 ``checksum`` of the metadata and the bytes, against accidents;
- ``gmac`` (a :class:`~kvgroups.store.entries.secret.StoreSecret`): a ``mac`` nobody without the secret
  can compute, against forgery;
- ``aes-256-gcm`` (a secret and ``encrypt=True``): the bytes are ciphertext, against reading too.

:func:`decode_entry` treats a stored value as hostile: sizes are checked before anything is
read, the header is parsed by this module (a few hundred bytes of JSON, capped), and *any*
failure, whatever raised it, is one :class:`CorruptEntryError` listing what is wrong. No pickle.
"""

from __future__ import annotations

import json
import math
import struct
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvgroups.core.dtypes import dtype_from_name, dtype_name
from kvgroups.errors import KVGroupsError
from kvgroups.store.entries.secret import TAG_BYTES, StoreSecret
from kvgroups.store.metrics.counters import ERROR_CORRUPT

ENTRY_FORMAT = "kvgroups.entry/1"
TENSOR_NAME = "kv"
_HEADER_LENGTH = struct.Struct("<Q")
# An entry's JSON header is a few hundred bytes; anything past this is not an entry.
MAX_HEADER_BYTES = 64 << 10
SEAL_MAC = "gmac"
SEAL_ENCRYPTED = "aes-256-gcm"
# safetensors' names of the dtypes an entry holds.
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
    torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.int64: "I64",
}
# Metadata fields that seal the others (not part of what they seal).
_SEAL_FIELDS = ("checksum", "mac")


class CorruptEntryError(KVGroupsError):
    """A stored value is not the entry it was asked as (or not an entry at all)."""

    kind = ERROR_CORRUPT  # what the metrics count it as (kvgroups_errors_total{kind})


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

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def max_entry_bytes(self) -> int:
        """The most bytes a valid entry of this kind can take (reads are capped at this)."""
        return _HEADER_LENGTH.size + MAX_HEADER_BYTES + self.tensor_bytes + TAG_BYTES


def _canonical(metadata: dict[str, str]) -> bytes:
    """The metadata that a checksum or MAC covers, as canonical JSON (every field but the seal's own)."""
    fields = {name: value for name, value in metadata.items() if name not in _SEAL_FIELDS}
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _checksum(metadata: dict[str, str], data: memoryview) -> str:
    digest = xxhash.xxh3_64()
    digest.update(_canonical(metadata))
    digest.update(data)
    return digest.hexdigest()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a one-element view keeps its stride, which no byte view takes
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    view: memoryview = flat.view(torch.uint8).numpy().data
    return view.cast("B")


def check_tensor(tensor: object, info: EntryInfo) -> None:
    """Raise unless ``tensor`` is a tensor of the entry's dtype and shape (every difference listed)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"group {info.group_index}, chunk {info.chunk_index}: an entry holds a tensor, got "
                        f"{type(tensor).__name__}")
    problems = []
    if tensor.dtype != info.dtype:
        problems.append(f"dtype {tensor.dtype} (expected {info.dtype})")
    if tuple(tensor.shape) != tuple(info.shape):
        problems.append(f"shape {list(tensor.shape)} (expected {list(info.shape)})")
    if problems:
        raise KVGroupsError(f"tensor for group {info.group_index}, chunk {info.chunk_index} has "
                            + ", ".join(problems))


def encode_entry(tensor: torch.Tensor, info: EntryInfo, *, secret: StoreSecret | None = None,
                 encrypt: bool = False) -> bytes:
    """The stored bytes of ``tensor`` as the entry ``info``, sealed with ``secret`` (encrypted with
    ``encrypt``); raises when the tensor is not what ``info`` says."""
    check_tensor(tensor, info)
    header, data = _sealed(_bytes_of(tensor.detach().to("cpu").contiguous()), info, secret, encrypt)
    return header + data


# Room a writer's slot keeps for an entry's header before its tensor: a header is a few hundred bytes.
HEADER_ROOM_BYTES = 4096


def entry_slot_bytes(info: EntryInfo) -> int:
    """The bytes of a writer's buffer that an entry ``info`` takes (:func:`entry_data`, :func:`seal_entry`)."""
    return (HEADER_ROOM_BYTES + info.tensor_bytes + 63) & ~63  # each slot 64-byte aligned


def entry_data(slot: torch.Tensor, info: EntryInfo) -> torch.Tensor:
    """Where, in ``slot`` (a contiguous 1-D uint8 CPU tensor of :func:`entry_slot_bytes`, which a writer
    reuses), the tensor of an entry ``info`` goes before :func:`seal_entry` puts its header in front: copied
    there once, straight from wherever it is (any strides, any device). A fresh entry-sized allocation per
    write costs more than the copy (its pages are faulted in anew every time)."""
    if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous() or slot.device.type != "cpu" \
            or slot.numel() < entry_slot_bytes(info):
        raise TypeError(f"an entry's slot must be a contiguous 1-D uint8 CPU tensor of at least "
                        f"{entry_slot_bytes(info)} bytes, got {slot.dtype} of shape {list(slot.shape)} on "
                        f"{slot.device}")
    return slot[HEADER_ROOM_BYTES:HEADER_ROOM_BYTES + info.tensor_bytes].view(info.dtype).view(info.shape)


def seal_entry(slot: torch.Tensor, info: EntryInfo, *, secret: StoreSecret | None = None,
               encrypt: bool = False) -> memoryview:
    """The stored bytes of the entry whose tensor :func:`entry_data` holds in ``slot``, sealed as
    :func:`encode_entry` seals them; a view of ``slot`` (encrypted: new bytes, the ciphertext's)."""
    data = entry_data(slot, info)
    if encrypt:
        header, ciphertext = _sealed(_bytes_of(data), info, secret, encrypt=True)
        return memoryview(header + ciphertext)
    whole: memoryview = slot.numpy().data.cast("B")
    data_end = HEADER_ROOM_BYTES + info.tensor_bytes
    header, _ = _sealed(whole[HEADER_ROOM_BYTES:data_end], info, secret, encrypt=False)
    start = HEADER_ROOM_BYTES - len(header)
    if start < 0:  # a header this long is nobody's; built the plain way all the same
        return memoryview(header + whole[HEADER_ROOM_BYTES:data_end])
    whole[start:HEADER_ROOM_BYTES] = header
    return whole[start:data_end]


def _sealed(data: memoryview, info: EntryInfo, secret: StoreSecret | None,
            encrypt: bool) -> tuple[bytes, memoryview]:
    """The header of an entry ``info`` holding ``data`` (its length prefix, its JSON padded to 8 bytes),
    and the bytes that follow it (``data``, or its ciphertext)."""
    if encrypt and secret is None:
        raise KVGroupsError("encrypt=True needs a secret")
    metadata = info.metadata()
    metadata["written"] = str(int(time.time()))  # sealed with the rest; not compared on reads
    stored_dtype, stored_shape = _SAFETENSORS_DTYPES[info.dtype], list(info.shape)
    if secret is None:
        metadata["checksum"] = _checksum(metadata, data)
    else:
        nonce = secret.nonce()
        metadata["seal"], metadata["nonce"] = (SEAL_ENCRYPTED if encrypt else SEAL_MAC), nonce.hex()
        if encrypt:
            data = memoryview(secret.encrypt(nonce, _canonical(metadata), data))
            stored_dtype, stored_shape = "U8", [data.nbytes]
        else:
            metadata["mac"] = secret.mac(nonce, _canonical(metadata), data).hex()
    header = {"__metadata__": metadata, TENSOR_NAME: {"dtype": stored_dtype, "shape": stored_shape,
                                                        "data_offsets": [0, data.nbytes]}}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return _HEADER_LENGTH.pack(len(text)) + text, data


def read_header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The JSON header of a stored value (its ``__metadata__`` a dict of str); raises
    :class:`CorruptEntryError` when there is none."""
    view = memoryview(data).cast("B")
    if view.nbytes < _HEADER_LENGTH.size:
        raise CorruptEntryError(f"value of {view.nbytes} bytes is too short to be an entry")
    (length,) = _HEADER_LENGTH.unpack_from(view)
    if length > min(MAX_HEADER_BYTES, view.nbytes - _HEADER_LENGTH.size):
        raise CorruptEntryError(f"header length {length} does not fit a value of {view.nbytes} bytes")
    try:
        header = json.loads(bytes(view[_HEADER_LENGTH.size:_HEADER_LENGTH.size + length]))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CorruptEntryError(f"entry header is not JSON: {error}") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise CorruptEntryError("entry header has no metadata of strings")
    parsed: dict[str, Any] = header
    return parsed


def decode_entry(data: bytes | bytearray | memoryview, expected: EntryInfo | None = None, *,
                 secret: StoreSecret | None = None) -> torch.Tensor:
    """The tensor of a stored value, when it is ``expected`` (or, without one, consistent in itself)
    and sealed as this reader seals (a MAC or encryption with ``secret``, else a checksum).

    Returns a tensor of its own memory. Raises :class:`CorruptEntryError`, and nothing else, for
    any value that is not such an entry: every field that differs is listed.
    """
    return _checked(data, expected, secret, copy=True)


def view_entry(data: bytes | bytearray | memoryview, expected: EntryInfo | None = None, *,
               secret: StoreSecret | None = None) -> torch.Tensor:
    """:func:`decode_entry` without the copy: the tensor is a view of ``data`` (a buffer the caller reuses
    only once it is done with the tensor; a read-only one, such as ``bytes``, gives a tensor that must
    only be read), except for encrypted entries, whose plaintext is new memory. Checked exactly as
    :func:`decode_entry` checks."""
    return _checked(data, expected, secret, copy=False)


def _checked(data: bytes | bytearray | memoryview, expected: EntryInfo | None, secret: StoreSecret | None,
             copy: bool) -> torch.Tensor:
    try:
        return _decode(memoryview(data).cast("B"), expected, secret, copy)
    except CorruptEntryError:
        raise
    except Exception as error:  # hostile bytes can make any parser or library call fail
        raise CorruptEntryError(f"entry does not decode: {type(error).__name__}: {error}") from None


def _decode(view: memoryview, expected: EntryInfo | None, secret: StoreSecret | None, copy: bool) -> torch.Tensor:
    if expected is not None and view.nbytes > expected.max_entry_bytes:
        raise CorruptEntryError(f"value of {view.nbytes} bytes is larger than any entry of {expected.key!r} "
                                f"({expected.max_entry_bytes})")
    header = read_header(view)
    metadata: dict[str, str] = header["__metadata__"]
    problems = []
    if metadata.get("format") != ENTRY_FORMAT:
        problems.append(f"format {metadata.get('format')!r} (expected {ENTRY_FORMAT!r})")
    if expected is not None:
        for field, value in expected.metadata().items():
            if field != "format" and metadata.get(field) != value:
                problems.append(f"{field} {metadata.get(field)!r} (expected {value!r})")
    seal = metadata.get("seal")
    if secret is None and seal is not None:
        problems.append(f"it is sealed ({seal}) with a secret this reader was not given")
    elif secret is not None and seal not in (SEAL_MAC, SEAL_ENCRYPTED):
        problems.append("it carries no MAC: it was written without this deployment's secret")
    if problems:
        raise CorruptEntryError("entry is not what was asked for: " + ", ".join(problems))
    dtype, shape = dtype_from_name(metadata["dtype"]), json.loads(metadata["shape"])
    if not isinstance(shape, list) or not all(isinstance(dim, int) and dim >= 0 for dim in shape):
        raise CorruptEntryError(f"entry shape {metadata['shape']!r} is not a list of sizes")
    tensor_bytes = math.prod(shape) * dtype.itemsize
    # What a plain safetensors reader would see must be what the metadata says: the tensor, or the
    # ciphertext and its tag as bytes.
    described = (_SAFETENSORS_DTYPES[dtype], shape) if seal != SEAL_ENCRYPTED else ("U8", [tensor_bytes + TAG_BYTES])
    payload = _payload(view, header, described, tensor_bytes + (0 if seal != SEAL_ENCRYPTED else TAG_BYTES))
    if seal is None:
        if metadata.get("checksum") != _checksum(metadata, payload):
            raise CorruptEntryError(f"entry checksum {metadata.get('checksum')!r} does not match its header and bytes")
    elif secret is not None:
        nonce = bytes.fromhex(metadata["nonce"])
        if seal == SEAL_MAC:
            if not secret.mac_holds(nonce, bytes.fromhex(metadata.get("mac", "")), _canonical(metadata), payload):
                raise CorruptEntryError("entry MAC does not hold: written without this secret, or changed since")
        else:
            plaintext = secret.decrypt(nonce, _canonical(metadata), payload)
            if plaintext is None:
                raise CorruptEntryError("entry does not decrypt: written without this secret, or changed since")
            return torch.frombuffer(bytearray(plaintext), dtype=torch.uint8).view(dtype).reshape(shape)
    if not copy:
        if not payload.nbytes:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            # A read-only value (a memory tier's bytes) makes a tensor its callers only read.
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)
    tensor = torch.empty(shape, dtype=dtype)
    _bytes_of(tensor)[:] = payload
    return tensor


def _payload(view: memoryview, header: dict[str, Any], dtype_and_shape: tuple[str, list[int]],
             payload_bytes: int) -> memoryview:
    """The stored bytes, where the header's one tensor says they are, when its dtype, shape and offsets
    are ``dtype_and_shape`` and ``payload_bytes``."""
    described = header.get(TENSOR_NAME)
    if not isinstance(described, dict) or set(header) != {"__metadata__", TENSOR_NAME}:
        raise CorruptEntryError(f"entry header must describe one tensor {TENSOR_NAME!r}, got {sorted(header)}")
    if set(described) != {"dtype", "shape", "data_offsets"} or \
            (described["dtype"], described["shape"]) != dtype_and_shape:
        raise CorruptEntryError(f"entry tensor is described as {described!r}; its metadata says dtype "
                                f"{dtype_and_shape[0]} shape {dtype_and_shape[1]}")
    offsets = described.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(at, int) for at in offsets)):
        raise CorruptEntryError(f"entry data_offsets {offsets!r} are not two ints")
    start = _HEADER_LENGTH.size + _HEADER_LENGTH.unpack_from(view)[0]
    begin, end = offsets
    if not 0 <= begin <= end or start + end != view.nbytes or end - begin != payload_bytes:
        raise CorruptEntryError(f"entry data_offsets {offsets} do not hold {payload_bytes} bytes "
                                f"in a value of {view.nbytes} bytes")
    return view[start + begin:start + end]
