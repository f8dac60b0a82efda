"""KVChunkStore: each group asked only for what it keeps; lookup never promises more than load serves,
load returns exactly what was saved; other fingerprints and salts never hit; failures cost misses."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgroups import (
    KVGroupsError,
    LMCacheMetadata,
    SlidingWindow,
)
from kvgroups.store import KVChunkStore, MemoryStore, open_store
from kvgroups.store.backends import health
from tests.support.servers import running_server
from tests.support.stored_chunks import build_metadata, chunk_tensors, saved_store

KINDS = ("full", "sliding", "chunked", "mla", "recurrent")


@dataclass
class Scenario:
    kinds: list[tuple[str, int]]
    chunk_size: int
    tokens: list[int]
    saved: list[int]  # chunk indices saved
    evicted: list[tuple[int, int]]  # (group, chunk) entries deleted afterwards


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    chunk_size = draw(st.sampled_from([4, 8, 16]))
    kinds = draw(st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from([4, 8, 12, 20, 33])), min_size=1, max_size=4,
    ))
    if any(kind == "mla" for kind, _ in kinds):
        kinds = [(kind, tokens) for kind, tokens in kinds if kind in ("mla", "recurrent")] or [("mla", 0)]
    length = draw(st.integers(0, 10 * chunk_size))
    tokens = draw(st.lists(st.integers(0, 50), min_size=length, max_size=length))
    full = length // chunk_size
    saved = sorted(draw(st.sets(st.integers(0, max(full - 1, 0)), max_size=full))) if full else []
    evicted = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, max(full - 1, 0))), max_size=4))
    return Scenario(kinds, chunk_size, tokens, saved, evicted)


def expected_boundary(store: KVChunkStore, available: set[tuple[int, int]], num_full: int) -> int:
    """The longest boundary every group can serve, by brute force over what is stored."""
    for boundary in range(num_full, 0, -1):
        if all(all((group, chunk) in available for chunk in store.needed_chunks(group, boundary))
               for group in range(len(store.groups))):
            return boundary * store.chunk_size
    return 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_lookup_never_promises_more_than_load_serves_and_load_is_exact(scenario: Scenario) -> None:
    metadata = build_metadata(scenario.kinds, chunk_size=scenario.chunk_size)
    with KVChunkStore(metadata, MemoryStore()) as store:
        keys = store.keys(scenario.tokens)
        saved: dict[int, list[torch.Tensor]] = {}
        for chunk in scenario.saved:
            saved[chunk] = chunk_tensors(store, scenario.tokens, chunk)
            store.save(scenario.tokens, chunk, saved[chunk], keys=keys)
        store.flush()
        available = {(group, chunk) for chunk in saved for group in range(len(store.groups))}
        for group, chunk in scenario.evicted:
            if group < len(store.groups) and chunk < len(keys):
                store.store.delete(store.entry_key(keys[chunk], group))
                available.discard((group, chunk))
        boundary = store.lookup(scenario.tokens)
        assert boundary == expected_boundary(store, available, len(keys))
        loaded = store.load(scenario.tokens, boundary)
        assert loaded.num_tokens == boundary
        if not boundary:
            assert loaded.groups == ()
            return
        num_chunks = boundary // store.chunk_size
        for part in loaded.groups:
            needed = store.needed_chunks(part.group_index, num_chunks)
            group = store.groups[part.group_index]
            if not group.token_indexed:
                assert part.first_token == boundary
                assert torch.equal(part.tensor, saved[num_chunks - 1][part.group_index])
                continue
            assert part.first_token == (needed.start * store.chunk_size if len(needed) else boundary)
            expected = [saved[chunk][part.group_index] for chunk in needed]
            want = torch.cat(expected, dim=2) if expected else torch.empty(group.chunk_shape(0), dtype=group.dtype)
            assert part.tensor.shape == want.shape and torch.equal(part.tensor, want)


def test_each_kind_asks_only_for_what_it_keeps() -> None:
    metadata = build_metadata([("full", 0), ("sliding", 20), ("chunked", 24), ("recurrent", 0)])
    with KVChunkStore(metadata, MemoryStore()) as store:
        full, sliding, chunked, recurrent = range(4)
        assert store.needed_chunks(full, 6) == range(0, 6)
        assert store.needed_chunks(sliding, 6) == range(3, 6)  # tokens 28..47 lie in chunks 3..5
        assert store.needed_chunks(sliding, 2) == range(0, 2)
        assert store.needed_chunks(chunked, 6) == range(6, 6)  # an attention chunk starts at token 48
        assert store.needed_chunks(chunked, 4) == range(3, 4)  # tokens 24..31
        assert store.needed_chunks(recurrent, 6) == range(5, 6)  # the state saved with chunk 5


def test_a_missing_recurrent_state_is_never_reported_as_a_hit() -> None:
    metadata = build_metadata([("full", 0), ("recurrent", 0)])
    tokens = list(range(40))
    with KVChunkStore(metadata, MemoryStore()) as store:
        keys = store.keys(tokens)
        for chunk in range(5):
            store.save(tokens, chunk, chunk_tensors(store, tokens, chunk), keys=keys)
        store.flush()
        assert store.lookup(tokens) == 40
        store.store.delete(store.entry_key(keys[4], 1))  # the state after chunk 4
        assert store.lookup(tokens) == 32  # the K/V of chunk 4 are there, its state is not
        store.store.delete(store.entry_key(keys[2], 0))
        assert store.lookup(tokens) == 16


def test_a_lookup_can_count_only_some_groups() -> None:
    """What a store holds of some groups (where another store holds the others': another rank's keys)."""
    metadata = build_metadata([("full", 0), ("recurrent", 0)])
    tokens = list(range(40))
    with KVChunkStore(metadata, MemoryStore()) as store:
        keys = store.keys(tokens)
        for chunk in range(5):
            store.save_chunk(keys[chunk], chunk, {0: chunk_tensors(store, tokens, chunk)[0]})  # K/V only
        store.flush()
        assert store.lookup(tokens) == 0  # no state anywhere
        assert store.locate(tokens, groups=[0]).num_tokens == 40
        assert store.locate(tokens, groups=[1]).num_tokens == 0
        assert store.locate(tokens, groups=[]).num_tokens == 0


def test_sliding_groups_read_only_their_window() -> None:
    """Gemma-3-like: 5 sliding (1024) layers per full layer, 256-token chunks, a 64k-token prefix."""
    kinds = [("sliding", 1024)] * 5 + [("full", 0)]
    metadata = build_metadata(kinds, num_kv_heads=1, chunk_size=256)
    tokens = [index % 1000 for index in range(65536)]
    with KVChunkStore(metadata, MemoryStore(max_bytes=1 << 30)) as store:
        keys = store.keys(tokens)
        shapes = [group.chunk_shape(256) for group in store.groups]
        for chunk in range(len(keys)):
            store.save(tokens, chunk, [torch.zeros(shape, dtype=torch.bfloat16) for shape in shapes], keys=keys)
        store.flush()
        assert store.lookup(tokens) == 65536
        loaded = store.load(tokens, 65536)
        sliding, full = store.groups[0], store.groups[1]
        assert sliding.spec == SlidingWindow(window_tokens=1024) and full.num_layers == 1
        parts = {part.group_index: part for part in loaded.groups}
        assert parts[0].first_token == 65536 - 1024 and parts[0].tensor.shape[2] == 1024
        assert parts[1].first_token == 0 and parts[1].tensor.shape[2] == 65536
        read = store.stats.bytes_read

        def stored(group: int, chunks: range) -> int:
            return sum(store.store.size_of(store.entry_key(keys[chunk], group)) or 0 for chunk in chunks)

        assert read[0] == stored(0, range(252, 256))  # the window: 4 of 256 chunks
        assert read[1] == stored(1, range(256))  # full attention: every chunk
        every_chunk = stored(0, range(256)) + stored(1, range(256))
        assert read[0] * 60 < stored(0, range(256)) and sum(read) < 0.2 * every_chunk


def test_another_fingerprint_or_salt_never_hits() -> None:
    tokens = list(range(32))
    shared = MemoryStore()
    saved_store(build_metadata([("full", 0)]), shared, tokens, salt="tenant-a")
    assert KVChunkStore(build_metadata([("full", 0)]), shared, salt="tenant-a").lookup(tokens) == 32
    assert KVChunkStore(build_metadata([("full", 0)]), shared, salt="tenant-b").lookup(tokens) == 0
    assert KVChunkStore(build_metadata([("full", 0)]), shared).lookup(tokens) == 0
    other_heads = build_metadata([("full", 0)], num_kv_heads=4)
    assert KVChunkStore(other_heads, shared, salt="tenant-a").lookup(tokens) == 0
    other_model = build_metadata([("full", 0)], model_name="other")
    assert KVChunkStore(other_model, shared, salt="tenant-a").lookup(tokens) == 0
    assert KVChunkStore(build_metadata([("full", 0)], chunk_size=16), shared, salt="tenant-a").lookup(tokens) == 0


def test_a_value_under_the_wrong_key_is_never_served(caplog: pytest.LogCaptureFixture) -> None:
    tokens_a, tokens_b = list(range(16)), list(range(100, 116))
    shared = MemoryStore()
    store = saved_store(build_metadata([("full", 0)]), shared, tokens_a)
    saved_store(build_metadata([("full", 0)]), shared, tokens_b)
    key_a, key_b = store.entry_key(store.keys(tokens_a)[1], 0), store.entry_key(store.keys(tokens_b)[1], 0)
    shared.put(key_a, shared.get(key_b) or b"")  # a store that mixed up two requests' values
    assert store.lookup(tokens_a) == 16  # present as far as the store can tell...
    with caplog.at_level(logging.WARNING):
        loaded = store.load(tokens_a, 16)
    assert loaded.num_tokens == 8  # ...but the wrong value is refused, and the shorter prefix served
    assert (store.stats.loads, store.stats.loaded_tokens, store.stats.short_loads) == (1, 8, 1)
    assert store.load(tokens_a, 8).num_tokens == 8 and store.stats.short_loads == 1  # all it asked for
    assert "is corrupt" in caplog.text and "key" in caplog.text
    assert torch.equal(loaded.groups[0].tensor, chunk_tensors(store, tokens_a, 0)[0])
    assert not shared.contains(key_a)


def test_a_server_stopped_mid_run_costs_misses_not_exceptions(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = list(range(64))
    metadata = build_metadata([("full", 0), ("sliding", 16)])
    with running_server(tmp_path / "first") as server:
        store = saved_store(metadata, server.url, tokens)
        assert store.lookup(tokens) == 64
        assert store.load(tokens, 64).num_tokens == 64
        server.stop()
        with caplog.at_level(logging.WARNING):
            assert store.lookup(tokens) == 0
            assert store.load(tokens, 64).num_tokens == 0
            store.save(tokens, 0, chunk_tensors(store, tokens, 0))
            store.flush()
        assert "lookup failed" in caplog.text
        # After one failure the store is left alone for a while: no request waits for its timeouts.
        assert store.stats.failed_reads == 1 and store.stats.dropped_saves == 1
    monkeypatch.setattr(health, "RETRY_AFTER_SECONDS", 0.0)
    with running_server(tmp_path / "again", port=server.port) as restarted:
        assert restarted.url == server.url
        assert store.lookup(tokens) == 0  # back, empty: a miss, then new saves land
        store.save(tokens, 0, chunk_tensors(store, tokens, 0))
        store.flush()
        assert store.lookup(tokens) == 8
    store.close()


def test_bad_input_raises_at_once() -> None:
    metadata = build_metadata([("full", 0), ("recurrent", 0)])
    with KVChunkStore(metadata, MemoryStore()) as store:
        tokens = list(range(20))
        good = chunk_tensors(store, tokens, 0)
        with pytest.raises(KVGroupsError, match=r"chunk_index 2 is not a full chunk of these 2 chunk"):
            store.save(tokens, 2, good)
        with pytest.raises(KVGroupsError, match=r"save got 1 tensors for 2 groups"):
            store.save(tokens, 0, good[:1])
        with pytest.raises(KVGroupsError, match=r"tensor for group 1, chunk 0 has dtype torch.float32 \(expected "
                                                r"torch.bfloat16\)"):
            store.save(tokens, 0, [good[0], good[1].float()])
        with pytest.raises(KVGroupsError, match=r"num_tokens 12 must be a multiple of chunk_size 8"):
            store.load(tokens, 12)
    with pytest.raises(KVGroupsError, match=r"metadata has no layer groups"):
        KVChunkStore(LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (1, 2, 256, 2, 4)), MemoryStore())
    with pytest.raises(KVGroupsError, match=r"unknown scheme"):
        KVChunkStore(metadata, "s3://bucket")


def test_mla_and_multi_tier_round_trip(tmp_path: Path) -> None:
    metadata = build_metadata([("mla", 0), ("mla", 0)])
    tokens = list(range(24))
    store = saved_store(metadata, ["memory://", f"file://{tmp_path}/kv"], tokens)
    assert store.lookup(tokens) == 24
    on_disk_only = KVChunkStore(metadata, open_store(f"file://{tmp_path}/kv"))
    loaded = on_disk_only.load(tokens, on_disk_only.lookup(tokens))
    assert loaded.num_tokens == 24 and loaded.groups[0].tensor.shape == (1, 2, 24, 12)
    expected = torch.cat([chunk_tensors(store, tokens, chunk)[0] for chunk in range(3)], dim=2)
    assert torch.equal(loaded.groups[0].tensor, expected)
    store.close()


def test_request_salts_keys_partial_saves_and_verify() -> None:
    tokens = list(range(24))
    shared = MemoryStore()
    store = KVChunkStore(build_metadata([("full", 0), ("recurrent", 0)]), shared)
    plain, salted = store.keys(tokens), store.keys(tokens, request_salt="cache-salt-1")
    assert len(plain) == len(salted) == 3 and not set(plain) & set(salted)
    assert store.keys(tokens, request_salt=b"cache-salt-1") == salted
    # Chunk 0 whole; chunk 1 without its state (the step did not end there); chunk 2 whole.
    for chunk, groups in ((0, (0, 1)), (1, (0,)), (2, (0, 1))):
        tensors = chunk_tensors(store, tokens, chunk)
        store.save_chunk(salted[chunk], chunk, {group: tensors[group] for group in groups})
    store.flush()
    assert store.lookup(tokens) == 0  # the unsalted keys name nothing
    assert store.lookup(None, keys=salted) == 24
    assert store.lookup(None, keys=salted[:2]) == 8  # no state at 16 tokens
    loaded = store.load(None, 24, keys=salted)
    assert loaded.num_tokens == 24
    assert torch.equal(loaded.groups[1].tensor, chunk_tensors(store, tokens, 2)[1])
    assert store.verify(None, 24, keys=salted) == 24
    shared.put(store.entry_key(salted[2], 1), b"garbage")
    assert store.lookup(None, keys=salted) == 24  # present as far as the store can tell...
    assert store.verify(None, 24, keys=salted) == 8  # ...but unreadable: 16 has no state, so 8
    with pytest.raises(KVGroupsError, match=r"num_tokens 32 is beyond the 3 keys given"):
        store.verify(None, 32, keys=salted)
    with pytest.raises(KVGroupsError, match=r"save names groups \[2\]"):
        store.save_chunk(salted[0], 0, {2: chunk_tensors(store, tokens, 0)[0]})


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_an_entry_reader_reads_each_entry_once_into_one_buffer_and_checks_it(tier: str, tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """What a vLLM worker streams: each entry read into the same buffer (a view, no copy), equal to what
    was saved, counted once; a corrupt entry is None, counted and deleted; a missing one None."""
    from kvgroups.store.chunks.entry_reads import EntryReader

    metadata = build_metadata([("full", 0), ("recurrent", 0)])
    url = "memory://" if tier == "memory" else f"file://{tmp_path}/kv"
    with KVChunkStore(metadata, url) as store:
        tokens = list(range(24))
        keys = store.keys(tokens)
        saved = [chunk_tensors(store, tokens, chunk) for chunk in range(3)]
        for chunk in range(3):
            store.save(tokens, chunk, saved[chunk], keys=keys)
        assert store.flush(10)
        reader = EntryReader(store)
        buffer = reader.buffer()
        for chunk in range(3):
            entry = reader.read(keys[chunk], 0, chunk, buffer)
            assert entry is not None and torch.equal(entry, saved[chunk][0])
            view = torch.frombuffer(buffer, dtype=torch.uint8)
            assert view.data_ptr() <= entry.data_ptr() < view.data_ptr() + len(buffer)
        payload = saved[0][0].numel() * saved[0][0].element_size()
        assert payload * 3 < store.stats.bytes_read[0] < payload * 3 + 3 * 1024  # once each, headers aside
        assert reader.read(keys[2], 1, 2, buffer) is not None and reader.read(keys[0], 1, 0, buffer) is not None
        stored = store.store.get(store.entry_key(keys[1], 0))
        assert stored is not None
        damaged = bytearray(stored)
        damaged[-3] ^= 0x10
        store.store.put(store.entry_key(keys[1], 0), bytes(damaged))
        assert reader.read(keys[1], 0, 1, buffer) is None
        assert store.stats.corrupt_entries == 1 and not store.store.contains(store.entry_key(keys[1], 0))
        assert "an entry is corrupt (1 so far), deleting it" in caplog.text
        assert reader.read(keys[1], 0, 1, buffer) is None and store.stats.corrupt_entries == 1  # now missing
