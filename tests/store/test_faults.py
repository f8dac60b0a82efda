"""Every fault a store can have costs hits, never an exception, a hang or another prefix's KV.

Damaged entries on every tier, a file far larger than any entry, a tier that refuses a value, a
server that hangs (SIGSTOP) behind a file tier, many threads on one server, a disk that fills up,
URL options that cannot work: each is a miss, a back-off or a clear error when the URL is parsed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgroups.cli import main
from kvgroups.core.sizes import MIB
from kvgroups.errors import KVGroupsError
from kvgroups.store import FileStore, KVChunkStore, MemoryStore, TieredStore, open_store
from kvgroups.store.backends.redis.store import RedisStore
from kvgroups.store.chunks.prefixes import LoadedPrefix
from kvgroups.store.entries.codec import decode_entry
from tests.support.servers import Server, running_server
from tests.support.stored_chunks import MIXED_KINDS, TOKENS, build_metadata, chunk_tensors, saved_store


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("faults-redis")) as started:
        yield started


def _tier(name: str, directory: Path, server: Server) -> object:
    if name == "memory":
        return MemoryStore()
    if name == "file":
        return FileStore(directory / f"kv-{time.monotonic_ns()}")
    store = open_store(server.url)
    store.clear()
    if name == "redis":
        return store
    return TieredStore([MemoryStore(), FileStore(directory / f"tier-{time.monotonic_ns()}"), store])


def _raw(store: object, key: str) -> bytes:
    value = store.get(key)  # type: ignore[attr-defined]
    assert value is not None
    return bytes(value)


def _mutations() -> st.SearchStrategy[tuple[str, int, int]]:
    """(what, where, how much): a flipped byte, a cut, appended bytes, another header length, an
    edited number in the header (a safetensors offset, the header length, a shape)."""
    return st.tuples(st.sampled_from(["flip", "truncate", "append", "header_length", "digit"]),
                     st.integers(0, 1 << 30), st.integers(1, 255))


def _mutate(value: bytes, what: str, where: int, amount: int) -> bytes:
    data = bytearray(value)
    if what == "flip":
        data[where % len(data)] ^= amount
    elif what == "truncate":
        del data[where % len(data):]
    elif what == "append":
        data += bytes([amount]) * amount
    elif what == "header_length":
        data[where % 8] ^= amount
    else:
        header_end = 8 + int.from_bytes(data[:8], "little")
        digits = [at for at in range(8, header_end) if chr(data[at]).isdigit()]
        at = digits[where % len(digits)]
        data[at] = ord(str((int(chr(data[at])) + 1 + amount % 9) % 10))
    return bytes(data)


@pytest.mark.parametrize("tier", ["memory", "file", "redis", "tiered"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(mutation=_mutations(), victim=st.integers(0, 1 << 30))
def test_damaged_entries_are_misses_on_every_tier(tier: str, tmp_path: Path, server: Server,
                                                  mutation: tuple[str, int, int], victim: int) -> None:
    metadata = build_metadata(MIXED_KINDS)
    store = saved_store(metadata, _tier(tier, tmp_path, server), TOKENS)
    keys = store.keys(TOKENS)
    entries = [store.entry_key(key, group) for key in keys for group in range(len(store.groups))]
    entries = [key for key in entries if store.store.contains(key)]
    damaged = entries[victim % len(entries)]
    original = _raw(store.store, damaged)
    changed = _mutate(original, *mutation)
    store.store.put(damaged, changed)
    expected = {chunk: chunk_tensors(store, TOKENS, chunk) for chunk in range(len(keys))}
    # Never an exception, whatever was damaged; exact values or a shorter prefix.
    boundary = store.lookup(TOKENS)
    verified = store.verify(TOKENS, boundary)
    loaded = store.load(TOKENS, boundary)
    assert verified <= boundary and loaded.num_tokens <= boundary
    _assert_exact(store, loaded, expected)
    chunk, group = _where(store, keys, damaged)
    if chunk in store.needed_chunks(group, len(keys)):
        assert loaded.num_tokens < 40  # the damaged entry was needed: never served, a shorter prefix is
    store.close()


@pytest.mark.parametrize(("old", "new"), [(b'"dtype":"BF16"', b'"dtype":"BF36"'),
                                          (b'"dtype":"BF16"', b'"dtype":"F16" '),
                                          (b'"shape":[2,1,8,8]', b'"shape":[1,2,8,8]')])
def test_a_tensor_described_otherwise_than_its_metadata_is_corrupt(old: bytes, new: bytes) -> None:
    # Found by the test above: an edited digit in the safetensors dtype ("BF16" -> "BF36") went unseen,
    # since the checksum covers the metadata and the bytes, not the safetensors description.
    store = saved_store(build_metadata(MIXED_KINDS), MemoryStore(), TOKENS)
    key = store.entry_key(store.keys(TOKENS)[0], 0)
    original = _raw(store.store, key)
    assert original.count(old) == 1
    with pytest.raises(KVGroupsError, match="entry tensor is described as"):
        decode_entry(original.replace(old, new), store.entry_info(store.keys(TOKENS)[0], 0, 0))
    store.close()


def _assert_exact(store: KVChunkStore, loaded: LoadedPrefix, expected: dict[int, list[torch.Tensor]]) -> None:
    """Every group of ``loaded`` holds exactly what was saved for its tokens (``expected``: per chunk)."""
    for part in loaded.groups:
        group = store.groups[part.group_index]
        if group.token_indexed:
            first = part.first_token // 8
            stored = torch.cat([expected[chunk][part.group_index] for chunk in range(first, loaded.num_tokens // 8)],
                               dim=2)
        else:
            stored = expected[loaded.num_tokens // 8 - 1][part.group_index]
        assert torch.equal(part.tensor, stored)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(copies=st.lists(st.sampled_from(["intact", "damaged", "absent"]), min_size=3, max_size=3),
       mutation=_mutations(), victim=st.integers(0, 1 << 30), reader=st.sampled_from(["load", "entry reader"]))
def test_a_damaged_copy_is_served_from_the_next_tier_that_holds_it_intact(
        tmp_path: Path, copies: list[str], mutation: tuple[str, int, int], victim: int, reader: str) -> None:
    """A flipped byte on disk with a good copy on the server behind it costs no miss: each copy a read meets
    that does not check out is counted and deleted from its tier alone, the next tier's is read (and
    promoted into the tiers in front); with no intact copy, it is a miss and no tier keeps the entry."""
    tiers = [MemoryStore(), FileStore(tmp_path / f"kv-{time.monotonic_ns()}"), MemoryStore()]
    store = saved_store(build_metadata(MIXED_KINDS), TieredStore(tiers), TOKENS)
    try:
        _read_past_damaged_copies(store, tiers, copies, mutation, victim, reader)
    finally:
        store.close()
        for tier in tiers:  # passed in, so not closed by the chunk store: a file tier keeps directories open
            tier.close()


def _read_past_damaged_copies(store: KVChunkStore, tiers: list[Any], copies: list[str],
                              mutation: tuple[str, int, int], victim: int, reader: str) -> None:
    from kvgroups.store.chunks.entry_reads import EntryReader

    keys = store.keys(TOKENS)
    needed = [(chunk, group) for group in range(len(store.groups)) for chunk in store.needed_chunks(group, len(keys))]
    chunk, group = needed[victim % len(needed)]
    key = store.entry_key(keys[chunk], group)
    original = _raw(tiers[0], key)
    for tier, copy in zip(tiers, copies, strict=True):
        if copy == "damaged":
            tier.put(key, _mutate(original, *mutation))
        elif copy == "absent":
            tier.delete(key)
    holders = [index for index, copy in enumerate(copies) if copy != "absent"]
    serving = next((index for index in holders if copies[index] == "intact"), None)
    expected = {index: chunk_tensors(store, TOKENS, index) for index in range(len(keys))}
    if reader == "load":
        loaded = store.load(TOKENS, len(TOKENS))
        _assert_exact(store, loaded, expected)
        assert (loaded.num_tokens == len(TOKENS)) == (serving is not None)
    else:
        entries = EntryReader(store)
        entry = entries.read(keys[chunk], group, chunk, entries.buffer())
        assert (entry is not None) == (serving is not None)
        assert entry is None or torch.equal(entry, expected[chunk][group])
    # Every damaged copy holds the same bytes: one bad read deletes each of them in front of an intact one.
    assert store.stats.corrupt_entries == any(index < (serving if serving is not None else len(tiers))
                                              for index in holders if copies[index] == "damaged")
    if serving is None:
        assert not any(tier.contains(key) for tier in tiers)
    else:
        for index, tier in enumerate(tiers):
            if index <= serving:  # the intact copy, and promoted in front of it
                assert _raw(tier, key) == original
            elif copies[index] == "absent":
                assert not tier.contains(key)
            else:  # behind the copy served: never read, left as it was
                assert _raw(tier, key) == (original if copies[index] == "intact" else _mutate(original, *mutation))


def _where(store: KVChunkStore, keys: list[str], entry: str) -> tuple[int, int]:
    """(chunk, group) of an entry key."""
    return next((chunk, group) for chunk, key in enumerate(keys) for group in range(len(store.groups))
                if store.entry_key(key, group) == entry)


def test_an_offset_digit_flipped_is_a_counted_miss_and_verify_reports_it(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped digit in ``data_offsets`` once escaped as safetensors' own error, on every read."""
    url = f"file://{tmp_path}/kv"
    store = saved_store(build_metadata(MIXED_KINDS), url, TOKENS)
    victim = store.entry_key(store.keys(TOKENS)[1], 0)
    value = bytearray(_raw(store.store, victim))
    offsets = value.index(b'"data_offsets":[0,') + len(b'"data_offsets":[0,')
    value[offsets] = ord("9") if value[offsets] != ord("9") else ord("1")
    store.store.put(victim, bytes(value))
    assert main(["store", "verify", url]) == 1
    out = capsys.readouterr()
    assert f"bad {victim}:" in out.out and "Traceback" not in out.out + out.err
    assert store.lookup(TOKENS) == 40  # present as far as the store can tell...
    assert store.verify(TOKENS, 40) == 8 and store.load(TOKENS, 40).num_tokens == 8  # ...then a counted miss
    assert store.stats.corrupt_entries >= 1 and not store.store.contains(victim)  # deleted
    store.close()


def test_a_huge_file_at_an_entry_path_is_not_read_whole(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    store = saved_store(build_metadata(MIXED_KINDS), url, TOKENS)
    victim = store.entry_key(store.keys(TOKENS)[0], 0)
    path = FileStore(tmp_path / "kv")._path(victim)
    with open(path, "r+b") as file:
        file.truncate(64 << 30)  # sparse: 64 GiB that would not fit in memory
    begin = time.monotonic()
    assert store.load(TOKENS, 40).num_tokens == 0
    assert time.monotonic() - begin < 5
    assert store.stats.corrupt_entries == 1 and not os.path.exists(path)
    store.close()


def test_a_tier_that_refuses_a_value_never_stops_the_others(tmp_path: Path) -> None:
    """A memory tier too small for an entry in front of a file tier: the file tier gets every entry,
    and a load that promotes hits into the small tier serves them all the same."""
    metadata = build_metadata(MIXED_KINDS, num_kv_heads=8)  # entries of over 1 KiB
    small = MemoryStore(max_bytes=1024)
    files = FileStore(tmp_path / "kv")
    store = saved_store(metadata, TieredStore([small, files]), TOKENS)
    entries = [store.entry_key(key, group) for key in store.keys(TOKENS) for group in range(3)]
    written = [key for key in entries if files.contains(key)]
    assert len(written) >= 3 * 5 - 4  # every entry the groups keep (the sliding window's early chunks too)
    assert store.stats.failed_saves == 0 and store.stats.dropped_saves == 0
    assert store.load(TOKENS, store.lookup(TOKENS)).num_tokens == 40
    assert store.store.tiers[0].tier_metrics.errors["too_large"] > 0  # the memory tier refused them
    store.close()


def test_a_hung_server_behind_a_file_tier_costs_one_timeout(tmp_path: Path) -> None:
    metadata = build_metadata(MIXED_KINDS)
    with running_server(tmp_path / "server") as server:
        url = f"{server.url}?timeout=1"
        store = saved_store(metadata, [f"file://{tmp_path}/kv", url], TOKENS)
        other = list(range(1000, 1040))
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            begin = time.monotonic()
            for _ in range(10):
                assert store.lookup(other) == 0  # the file tier misses; the server is asked once
            assert time.monotonic() - begin < 1.0 + 1.5
            begin = time.monotonic()
            store.save(other, 0, chunk_tensors(store, other, 0))
            assert time.monotonic() - begin < 0.2  # a save never waits for a store
            assert store.lookup(TOKENS) == 40  # what the file tier holds is served meanwhile
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        store.close(timeout=10)


def test_many_threads_share_one_redis_store(server: Server) -> None:
    store = open_store(server.url)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for round_ in range(5):
                store.put(f"t{worker}-{round_}", bytes([worker % 256]) * 2048)
                assert store.get(f"t{worker}-{round_}") == bytes([worker % 256]) * 2048
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(150)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    store.close()


@pytest.mark.parametrize(("url", "message"), [
    ("redis://localhost:1/0?ttl=0.2", r"ttl='0.2' must be a positive number of whole seconds"),
    ("redis://localhost:1/0?ttl=0", r"ttl='0' must be a positive number of whole seconds"),
    ("redis://localhost:1/0?timeout=inf", r"timeout='inf' must be a finite, positive number"),
    ("redis://localhost:1/0?timeout=nan", r"timeout='nan' must be a finite, positive number"),
    ("redis://localhost:1/0?max_connections=0", r"max_connections='0' must be a whole number >= 1"),
    ("rediss://localhost:1/0?ssl_cert_reqs=maybe", r"ssl_cert_reqs='maybe'"),
    ("redis://localhost:1/0?ssl_ca_certs=/x", r"unknown option 'ssl_ca_certs'"),
])
def test_options_that_cannot_work_are_refused_when_parsed(url: str, message: str) -> None:
    with pytest.raises(KVGroupsError, match=message):
        open_store(url)


def test_a_server_restart_recovers_after_the_back_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgroups.store.backends import health

    monkeypatch.setattr(health, "RETRY_AFTER_SECONDS", 0.5)
    metadata = build_metadata([("full", 0)])
    with running_server(tmp_path / "first") as server:
        store = KVChunkStore(metadata, server.url)
        server.stop()
        assert store.lookup(TOKENS) == 0 and store.stats.failed_reads == 1
        with running_server(tmp_path / "again", port=server.port):
            time.sleep(0.6)
            keys = store.keys(TOKENS)
            for chunk in range(5):
                store.save(TOKENS, chunk, chunk_tensors(store, TOKENS, chunk), keys=keys)
            assert store.flush(timeout=10)
            assert store.lookup(TOKENS) == 40
        store.close()


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs, mounted for the test (the tests run as root)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mount)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_evicts_and_saves_go_on(small_filesystem: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = FileStore(small_filesystem / "kv")
    assert files.max_bytes <= 24 * MIB  # the default budget fits the filesystem
    # Another program fills most of the disk behind the store's back: the budget cannot see it.
    (small_filesystem / "other.bin").write_bytes(bytes(14 * MIB))
    metadata = build_metadata([("full", 0)], num_kv_heads=64, chunk_size=256)  # 256 KiB per entry
    tokens = list(range(256 * 64))  # 16 MiB of entries, more than the 10 MiB left
    with caplog.at_level(logging.WARNING), KVChunkStore(metadata, files) as store:
        keys = store.keys(tokens)
        for chunk in range(64):
            store.save(tokens, chunk, chunk_tensors(store, tokens, chunk), keys=keys)
            assert store.flush(timeout=30)
        assert store.stats.failed_saves == 0 and store.stats.saved_chunks == 64
        assert files.evictions > 0  # the disk filled, older entries went, every save landed
        newest = decode_entry(_raw(store.store, store.entry_key(keys[-1], 0)), store.entry_info(keys[-1], 0, 63))
        assert torch.equal(newest, chunk_tensors(store, tokens, 63)[0])


def test_store_cli_on_a_path_that_does_not_exist_creates_nothing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("stats", "verify", "clear"):
        assert main(["store", command, f"file://{tmp_path}/missing"]) == 2
        assert "no store there" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()


def test_verify_json_lists_bad_entries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/kv"
    store = saved_store(build_metadata(MIXED_KINDS), url, TOKENS)
    victim = store.entry_key(store.keys(TOKENS)[0], 0)
    store.store.put(victim, _raw(store.store, victim)[:-3])
    assert main(["store", "verify", url, "--json", "--delete"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [entry["key"] for entry in report["bad"]] == [victim] and report["deleted"] == 1
    store.close()


def test_redis_reads_are_capped_too(server: Server) -> None:
    tier = open_store(server.url)
    assert isinstance(tier, RedisStore)
    tier.put("big", bytes(3 * MIB))
    assert tier.get("big", max_bytes=1000) == bytes(1001)  # cut: longer than any entry, never read whole
    assert tier.get_many(["big", "nothing"], max_bytes=10) == [bytes(11), None]
    tier.close()
