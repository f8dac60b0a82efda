"""Entries built in a writer's reused slot (entry_data + seal_entry) are encode_entry's bytes, for any
source strides, dtype and seal; a slot that cannot hold the entry is refused."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups.store.entries import codec
from kvgroups.store.entries.codec import (
    HEADER_ROOM_BYTES,
    CorruptEntryError,
    EntryInfo,
    decode_entry,
    encode_entry,
    entry_data,
    entry_slot_bytes,
    seal_entry,
)
from kvgroups.store.entries.secret import StoreSecret

SECRET = StoreSecret(b"k" * 32)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64)


def _info(key: str, dtype: torch.dtype, numel: int) -> EntryInfo:
    return EntryInfo(key=key, fingerprint="f" * 64, group_index=0, chunk_index=0, dtype=dtype, shape=(numel,))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       permutation_seed=st.integers(0, 1000), seal=st.sampled_from(("checksum", "mac", "encrypted")),
       key_length=st.integers(1, 300), reuse=st.booleans())
def test_an_entry_sealed_in_a_slot_is_the_entry_encode_entry_writes(
        dtype: torch.dtype, shape: list[int], permutation_seed: int, seal: str, key_length: int, reuse: bool) -> None:
    generator = torch.Generator().manual_seed(permutation_seed)
    if dtype == torch.int64:  # token ids and positions: any 64-bit value
        base = torch.randint(-(1 << 62), 1 << 62, (*shape, 2), dtype=torch.int64, generator=generator)
    elif dtype.itemsize == 1:
        base = torch.randint(0, 256, (*shape, 2), dtype=torch.uint8, generator=generator).view(dtype)
    else:
        base = torch.randn(*shape, 2, generator=generator).to(dtype)
    order = torch.randperm(base.dim(), generator=generator).tolist()
    source = base.permute(*order)[..., 0]  # strided, as a page in a host pool is
    info = _info("k" * key_length, dtype, source.numel())
    slot = torch.full((entry_slot_bytes(info) + 64,), 0xAB, dtype=torch.uint8) if reuse else \
        torch.empty(entry_slot_bytes(info), dtype=torch.uint8)
    secret = None if seal == "checksum" else SECRET
    encrypt = seal == "encrypted"
    with mock.patch.object(codec.time, "time", return_value=1_800_000_000.0):
        entry_data(slot, info).view(source.shape).copy_(source)
        sealed = seal_entry(slot, info, secret=secret, encrypt=encrypt)
        plain = encode_entry(source.reshape(-1), info, secret=secret, encrypt=encrypt)
    if not encrypt:  # a nonce is fresh on every seal: only the unencrypted bytes can match exactly
        assert seal == "mac" or bytes(sealed) == plain
    decoded = decode_entry(sealed, info, secret=secret)
    assert torch.equal(decoded.view(torch.uint8), torch.empty(source.numel(), dtype=dtype).copy_(source.reshape(-1))
                       .view(torch.uint8))
    assert sealed.nbytes == len(plain)


def test_a_flipped_byte_in_a_sealed_slot_is_corrupt() -> None:
    info = _info("key", torch.bfloat16, 1024)
    slot = torch.empty(entry_slot_bytes(info), dtype=torch.uint8)
    entry_data(slot, info).copy_(torch.randn(1024).to(torch.bfloat16))
    stored = bytearray(seal_entry(slot, info))
    stored[-5] ^= 0x01
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode_entry(stored, info)


def test_a_header_longer_than_the_room_is_built_in_front_all_the_same() -> None:
    info = _info("k" * (HEADER_ROOM_BYTES + 100), torch.float32, 16)
    slot = torch.empty(entry_slot_bytes(info), dtype=torch.uint8)
    entry_data(slot, info).copy_(torch.arange(16, dtype=torch.float32))
    assert torch.equal(decode_entry(seal_entry(slot, info), info), torch.arange(16, dtype=torch.float32))


@pytest.mark.parametrize(("slot", "problem"), [
    (torch.empty(100, dtype=torch.uint8), "of shape \\[100\\]"),
    (torch.empty(20000, dtype=torch.int8), "torch.int8"),
    (torch.empty(2, 20000, dtype=torch.uint8), "of shape \\[2, 20000\\]"),
    (torch.empty(40000, dtype=torch.uint8)[::2], "contiguous"),
])
def test_a_slot_that_cannot_hold_the_entry_is_refused_naming_what_it_is(slot: torch.Tensor, problem: str) -> None:
    info = _info("key", torch.float32, 1024)
    with pytest.raises(TypeError, match=f"at least {entry_slot_bytes(info)} bytes.*{problem}|{problem}"):
        entry_data(slot, info)
