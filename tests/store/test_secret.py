"""A deployment secret: keys nobody else can compute, entries nobody else can forge or read; and
what a store without one allows (the documented limit)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from kvgroups.cli import main
from kvgroups.errors import KVGroupsError
from kvgroups.store import KVChunkStore, MemoryStore, StoreSecret, prefix_keys
from kvgroups.store.entries.codec import EntryInfo, decode_entry, encode_entry, read_header
from tests.support.stored_chunks import build_metadata, chunk_tensors

SECRET = "correct horse battery staple, 2026"
TOKENS = list(range(24))


def forge(stored: bytes, info: EntryInfo) -> bytes:
    """What a store writer without the secret can do: read the header, change the values, recompute
    the checksum (an unkeyed xxh3) and write the entry back."""
    header = read_header(stored)["__metadata__"]
    shape, dtype = json.loads(header["shape"]), info.dtype
    planted = torch.full(shape, 7.0).to(dtype)
    return encode_entry(planted, info)


def saved(store: KVChunkStore) -> list[str]:
    keys = store.keys(TOKENS)
    for chunk in range(3):
        store.save(TOKENS, chunk, chunk_tensors(store, TOKENS, chunk), keys=keys)
    assert store.flush(timeout=10)
    return keys


def test_a_forged_entry_is_served_without_a_secret_and_missed_with_one() -> None:
    metadata = build_metadata([("full", 0)])
    for secret, served in ((None, True), (SECRET, False)):
        shared = MemoryStore()
        store = KVChunkStore(metadata, shared, secret=secret)
        keys = saved(store)
        victim = store.entry_key(keys[1], 0)
        shared.put(victim, forge(shared.get(victim) or b"", store.entry_info(keys[1], 0, 1)))
        loaded = store.load(TOKENS, store.lookup(TOKENS))
        if served:  # the documented limit: without a secret, whoever can write the store changes answers
            assert loaded.num_tokens == 24 and bool((loaded.groups[0].tensor[:, :, 8:16] == 7).all())
        else:
            assert loaded.num_tokens == 8 and store.stats.corrupt_entries == 1
            assert torch.equal(loaded.groups[0].tensor, chunk_tensors(store, TOKENS, 0)[0])


def test_keys_with_a_secret_match_no_key_without_it() -> None:
    metadata = build_metadata([("full", 0)])
    plain = KVChunkStore(metadata, MemoryStore()).keys(TOKENS)
    keyed = KVChunkStore(metadata, MemoryStore(), secret=SECRET).keys(TOKENS)
    other = KVChunkStore(metadata, MemoryStore(), secret=SECRET + "!").keys(TOKENS)
    assert len(keyed) == 3 and not set(keyed) & set(plain) and not set(keyed) & set(other)
    assert KVChunkStore(metadata, MemoryStore(), secret=SECRET).keys(TOKENS) == keyed  # stable
    # A store reader knows the namespace and the tokens it guesses, but cannot compute the next key.
    namespace = KVChunkStore(metadata, MemoryStore()).namespace
    assert prefix_keys(TOKENS, 8, namespace) == plain and keyed[0] not in prefix_keys(TOKENS, 8, namespace)


def test_encrypted_entries_hold_no_raw_bytes() -> None:
    metadata = build_metadata([("full", 0), ("recurrent", 0)])
    shared = MemoryStore()
    store = KVChunkStore(metadata, shared, secret=SECRET, encrypt=True)
    keys = saved(store)
    for chunk, key in enumerate(keys):
        tensors = chunk_tensors(store, TOKENS, chunk)
        for group, tensor in enumerate(tensors):
            value = shared.get(store.entry_key(key, group))
            assert value is not None
            raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert raw[:64] not in value and raw[-64:] not in value  # nothing of the plaintext
    loaded = store.load(TOKENS, store.lookup(TOKENS))
    assert loaded.num_tokens == 24
    assert torch.equal(loaded.groups[1].tensor, chunk_tensors(store, TOKENS, 2)[1])
    # Without the secret nothing is even addressed; with another one nothing decrypts.
    assert KVChunkStore(metadata, shared).lookup(TOKENS) == 0
    stranger = KVChunkStore(metadata, shared, secret="another secret of twenty")
    assert stranger.load(None, 24, keys=keys).num_tokens == 0


def test_entries_written_without_the_secret_are_misses_with_it() -> None:
    metadata = build_metadata([("full", 0)])
    shared = MemoryStore()
    plain = KVChunkStore(metadata, shared)
    keys = saved(plain)
    keyed = KVChunkStore(metadata, shared, secret=SECRET)
    # Even under the same keys (a writer who learnt them), an entry without the MAC is refused.
    assert keyed.load(None, 24, keys=keys).num_tokens == 0 and keyed.stats.corrupt_entries == 3


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    metadata = build_metadata([("full", 0)])
    monkeypatch.setenv("KVGROUPS_STORE_SECRET", SECRET)
    from_env = KVChunkStore(metadata, MemoryStore())
    assert from_env.secret is not None and from_env.keys(TOKENS) == KVChunkStore(metadata, MemoryStore(),
                                                                                 secret=SECRET).keys(TOKENS)
    (tmp_path / "secret").write_text(SECRET + "\n")
    assert StoreSecret.from_file(tmp_path / "secret").identity == StoreSecret(SECRET).identity
    assert repr(StoreSecret(SECRET)) == "StoreSecret(<set>)" and SECRET not in repr(from_env.secret)
    with pytest.raises(KVGroupsError, match=r"at least 16 bytes, got 5"):
        StoreSecret("short")
    with pytest.raises(KVGroupsError, match=r"cannot read the secret file"):
        StoreSecret.from_file(tmp_path / "missing")
    monkeypatch.delenv("KVGROUPS_STORE_SECRET")
    with pytest.raises(KVGroupsError, match=r"encrypt=True needs a secret"):
        KVChunkStore(metadata, MemoryStore(), encrypt=True)
    assert SECRET not in caplog.text


def test_store_verify_checks_macs_with_the_secret_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/kv"
    (tmp_path / "secret").write_text(SECRET)
    os.chmod(tmp_path / "secret", 0o600)
    store = KVChunkStore(build_metadata([("full", 0)]), url, secret=SECRET)
    saved(store)
    assert main(["store", "verify", url, "--secret-file", str(tmp_path / "secret")]) == 0
    assert "3 entries" in capsys.readouterr().out
    assert main(["store", "verify", url]) == 1  # without it, sealed entries cannot be checked: reported
    out = capsys.readouterr().out
    assert "sealed (gmac) with a secret this reader was not given" in out and SECRET not in out


def test_a_sealed_entry_round_trips_and_names_its_seal() -> None:
    info = EntryInfo(key="k.g0", fingerprint="f", group_index=0, chunk_index=0, dtype=torch.float16, shape=(2, 3))
    tensor = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    secret = StoreSecret(SECRET)
    for encrypt, seal in ((False, "gmac"), (True, "aes-256-gcm")):
        value = encode_entry(tensor, info, secret=secret, encrypt=encrypt)
        assert read_header(value)["__metadata__"]["seal"] == seal and "checksum" not in read_header(value)
        assert torch.equal(decode_entry(value, info, secret=secret), tensor)
    logging.getLogger("kvgroups").debug("no secret here")
