"""KV events: the store's contents as vLLM's BlockStored / BlockRemoved, through vLLM's real Scheduler.

Each engine runs vLLM's Scheduler with KV events on and its prefix cache on, so that the events vLLM
publishes for its own blocks (medium GPU) sit beside the connector's (medium DISK, a file store) in
the same batches; fake workers write and read a real file store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvgroups.store import FileStore
from tests.integrations.vllm.harness import FakeWorker, SchedulerHarness, cache_config, prompt, vllm_config

CHUNK, BLOCK, WINDOW = 32, 16, 32
KINDS = ["sliding", "full"]  # vLLM groups 0 and 1


def engine(model_dir: Path, extra: dict[str, Any], seed: int) -> tuple[SchedulerHarness, FakeWorker, list[Any]]:
    kv = cache_config(KINDS, block_size=BLOCK, window=WINDOW)
    config = vllm_config(model_dir, extra, kv_events=True, prefix_caching=True)
    harness = SchedulerHarness(config, kv)
    published: list[Any] = []
    harness.scheduler.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    return harness, FakeWorker(config, kv, seed=seed), published


def store_events(published: list[Any]) -> list[Any]:
    return [event for batch in published for event in batch.events if getattr(event, "medium", None) == "DISK"]


def vllms_own(published: list[Any], group: int) -> list[BlockStored]:
    return [event for batch in published for event in batch.events
            if isinstance(event, BlockStored) and event.medium != "DISK" and event.group_idx == group]


def serve(harness: SchedulerHarness, worker: FakeWorker, request_id: str, tokens: list[int]) -> Any:
    request = harness.add(request_id, tokens)
    harness.run(worker)  # then every save is written: the next step reports it
    harness.step(worker)
    return request


def extra(tmp_path: Path, **settings: Any) -> dict[str, Any]:
    return {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK, **settings}


def test_written_chunks_are_announced_with_vllms_own_block_hashes(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    harness, worker, published = engine(gemma3_dir, extra(tmp_path), seed=0)
    request = serve(harness, worker, "fill", tokens)
    hashes = [maybe_convert_block_hash(block_hash) for block_hash in request.block_hashes]
    ours = store_events(published)
    # Each group's 3 chunks (the prompt ran in one step: the sliding group held all of it then).
    assert sorted((event.group_idx, event.block_hashes[0]) for event in ours) == sorted(
        (group, hashes[block]) for group in (0, 1) for block in (0, 2, 4))
    for event in ours:
        first = hashes.index(event.block_hashes[0])
        assert isinstance(event, BlockStored)
        assert event.block_hashes == hashes[first:first + 2] and event.block_size == BLOCK
        assert event.parent_block_hash == (hashes[first - 1] if first else None)
        assert event.token_ids == tokens[first * BLOCK:(first + 2) * BLOCK]
        (own,) = vllms_own(published, event.group_idx)  # vLLM's own event of the group's 6 blocks agrees
        assert own.block_hashes[first:first + 2] == event.block_hashes
        assert own.token_ids[first * BLOCK:(first + 2) * BLOCK] == event.token_ids
        assert (event.lora_id, event.lora_name) == (own.lora_id, own.lora_name) == (None, None)
        assert event.extra_keys == own.extra_keys[first:first + 2] == [None, None]
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (
            own.kv_cache_spec_kind, own.kv_cache_spec_sliding_window)
    assert {event.kv_cache_spec_kind for event in ours} == {"sliding_window", "full_attention"}
    full = [hash_ for event in vllms_own(published, 1) for hash_ in event.block_hashes]
    assert full == hashes[:6]  # vLLM's own hashes of the 96 tokens the store announced for the full group
    harness.step(worker)
    assert len(store_events(published)) == 6  # each announced once


def test_a_dropped_save_is_never_announced(gemma3_dir: Path, tmp_path: Path) -> None:
    harness, worker, published = engine(gemma3_dir, extra(tmp_path, max_pending_bytes=1), seed=0)
    serve(harness, worker, "fill", prompt(100))
    assert vllms_own(published, 1) and not store_events(published)


def test_loads_are_announced_and_a_corrupt_entry_removed(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    harness, first, _ = engine(gemma3_dir, extra(tmp_path), seed=0)
    request = serve(harness, first, "fill", tokens)
    hashes = [maybe_convert_block_hash(block_hash) for block_hash in request.block_hashes]
    # A second engine on the same store announces what it loads, once it is loaded (of the sliding
    # group, the last chunk: the window needs no more).
    harness, second, published = engine(gemma3_dir, extra(tmp_path), seed=1)
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 96 and load.asynchronous
    harness.step(second)
    assert sorted((event.group_idx, tuple(event.block_hashes)) for event in store_events(published)) == sorted(
        [(1, tuple(hashes[0:2])), (1, tuple(hashes[2:4])), (1, tuple(hashes[4:6])), (0, tuple(hashes[4:6]))])
    # An entry damaged: the next engine's load finds it corrupt, deletes it, and says so.
    keys = first.side.store.keys(np.asarray(tokens, dtype=np.uint32), request_salt=load.request_salt)
    store = FileStore(f"{tmp_path}/kv")
    damaged = bytearray(store.get(f"{keys[1]}.g1") or b"")
    damaged[len(damaged) // 2] ^= 0x01
    store.put(f"{keys[1]}.g1", bytes(damaged))
    harness, third, published = engine(gemma3_dir, extra(tmp_path), seed=2)
    harness.add("damaged", tokens)
    steps, computed, _ = harness.admit(third, "damaged")
    assert any(step.failed_loads == {"damaged"} for step in steps)
    harness.step(third)
    # (The recomputed request is saved again: its BlockStored may follow, as soon as it is written.)
    (removed,) = [event for event in store_events(published) if isinstance(event, BlockRemoved)]
    assert (removed.block_hashes, removed.group_idx) == (hashes[2:4], 1)
    assert not [event for event in store_events(published)[:store_events(published).index(removed)]
                if isinstance(event, BlockStored)]  # the failed load announced nothing
    assert store.get(f"{keys[1]}.g1") != bytes(damaged)  # deleted (and maybe saved again since, recomputed)


def test_an_entry_damaged_in_front_of_a_good_copy_loads_from_it_and_is_never_removed(gemma3_dir: Path,
                                                                                       tmp_path: Path) -> None:
    """Two tiers (a file store in front of another, as a node's disk in front of a shared server): a copy
    damaged in the front tier alone is read from the one behind, so the load succeeds, nothing is
    announced removed, and the front tier holds the good copy again."""
    tokens = prompt(100)
    tiers = {"store": [f"file://{tmp_path}/front", f"file://{tmp_path}/behind"]}
    harness, first, _ = engine(gemma3_dir, extra(tmp_path, **tiers), seed=0)
    request = serve(harness, first, "fill", tokens)
    hashes = [maybe_convert_block_hash(block_hash) for block_hash in request.block_hashes]
    keys = first.side.store.keys(np.asarray(tokens, dtype=np.uint32))
    front, behind = FileStore(f"{tmp_path}/front"), FileStore(f"{tmp_path}/behind")
    good = front.get(f"{keys[1]}.g1")
    assert good is not None and behind.get(f"{keys[1]}.g1") == good
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x01
    front.put(f"{keys[1]}.g1", bytes(damaged))
    harness, second, published = engine(gemma3_dir, extra(tmp_path, **tiers), seed=1)
    harness.add("reuse", tokens)
    steps, computed, load = harness.admit(second, "reuse")
    assert computed == 96 and load.asynchronous and not any(step.failed_loads for step in steps)
    harness.step(second)
    assert not [event for event in store_events(published) if isinstance(event, BlockRemoved)]
    assert (1, tuple(hashes[2:4])) in [(event.group_idx, tuple(event.block_hashes))
                                       for event in store_events(published)]  # the chunk loaded, announced
    stats = second.side.store.stats
    assert (stats.corrupt_entries, stats.short_loads, stats.loaded_tokens) == (1, 0, 96)
    assert front.get(f"{keys[1]}.g1") == good  # promoted from behind


def test_without_kv_events_nothing_is_tracked(gemma3_dir: Path, tmp_path: Path) -> None:
    kv = cache_config(KINDS, block_size=BLOCK, window=WINDOW)
    config = vllm_config(gemma3_dir, extra(tmp_path))
    harness, worker = SchedulerHarness(config, kv), FakeWorker(config, kv, seed=0)
    serve(harness, worker, "fill", prompt(100))
    assert harness.connector._scheduler.events is None and worker.side.reports is None
    assert list(harness.connector.take_events()) == []


def test_entries_the_store_evicts_are_announced_removed(gemma3_dir: Path, tmp_path: Path) -> None:
    """A file tier of about 1.5 prompts' entries: the second prompt's saves evict the first's oldest,
    and exactly those blocks are announced removed (the store no longer holds them)."""
    from kvgroups.integrations.vllm.plans import request_salt

    harness, worker, published = engine(gemma3_dir, {"store": f"file://{tmp_path}/kv?max_bytes=300000",
                                                     "chunk_size": CHUNK}, seed=0)
    requests = [serve(harness, worker, "first", prompt(100)), serve(harness, worker, "second", prompt(100, seed=1))]
    store = FileStore(f"{tmp_path}/kv")
    gone = []  # per prompt, (vLLM group, the chunk's block hashes) of the entries the store no longer holds
    for request, tokens in zip(requests, (prompt(100), prompt(100, seed=1)), strict=True):
        hashes = [maybe_convert_block_hash(block_hash) for block_hash in request.block_hashes]
        keys = worker.side.store.keys(np.asarray(tokens, dtype=np.uint32), request_salt=request_salt(request) or "")
        gone.append({(group, tuple(hashes[2 * chunk:2 * chunk + 2])) for chunk in range(3) for group in (0, 1)
                     if store.get(f"{keys[chunk]}.g{group}") is None})  # kvgroups group g is vLLM group g here
    removed = [(event.group_idx, tuple(event.block_hashes)) for event in store_events(published)
               if isinstance(event, BlockRemoved)]
    # Every entry of the first prompt the store evicted was announced (all of it was, before the second
    # came) and is announced removed, once; of the second's, those evicted after they were announced.
    assert gone[0] and len(removed) == len(set(removed)) and gone[0] <= set(removed) <= gone[0] | gone[1]


def test_under_tensor_parallelism_a_chunk_is_announced_once_every_rank_wrote_it(gemma3_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """Each rank writes its own entries: a chunk's blocks are announced when every rank's are written,
    never on one rank's word (rank 1's reports held back until the end), and then once."""
    kv = cache_config(KINDS, block_size=BLOCK, window=WINDOW)
    config = vllm_config(gemma3_dir, extra(tmp_path), kv_events=True, prefix_caching=True, tp=2)
    harness = SchedulerHarness(config, kv)
    published: list[Any] = []
    harness.scheduler.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    ranks = (FakeWorker(config, kv, seed=0, rank=0), FakeWorker(config, kv, seed=1, rank=1))
    reports = ranks[1].side.reports
    assert reports is not None
    take = reports.take
    reports.take = lambda: None  # type: ignore[method-assign]  # rank 1 keeps what it wrote to itself meanwhile
    harness.add("fill", prompt(100))
    harness.run(ranks)
    harness.step(ranks)
    assert not store_events(published)  # rank 0 wrote everything; rank 1's word has not come
    reports.take = take  # type: ignore[method-assign]
    harness.step(ranks)
    harness.step(ranks)
    assert sorted(event.group_idx for event in store_events(published)) == [0, 0, 0, 1, 1, 1]


def test_a_synchronous_load_is_announced_from_its_own_step(gemma3_dir: Path, tmp_path: Path) -> None:
    """One KV-cache group, loads before the forward: a load that worked is announced with the output of
    the step it ran in (its request may finish in that step); one that found an entry corrupt is not."""
    tokens, settings = prompt(100), {"load_mode": "sync"}

    def one_group(seed: int) -> tuple[SchedulerHarness, FakeWorker, list[Any]]:
        kv = cache_config(["full"], block_size=BLOCK)
        config = vllm_config(gemma3_dir, extra(tmp_path, **settings), kv_events=True, prefix_caching=True)
        harness = SchedulerHarness(config, kv)
        published: list[Any] = []
        harness.scheduler.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
        return harness, FakeWorker(config, kv, seed=seed), published

    harness, first, _ = one_group(0)
    request = serve(harness, first, "fill", tokens)
    hashes = [maybe_convert_block_hash(block_hash) for block_hash in request.block_hashes]
    harness, second, published = one_group(1)
    harness.add("reuse", tokens, max_tokens=1)
    steps, computed, load = harness.admit(second, "reuse")
    assert computed == 96 and not load.asynchronous and len(steps) == 1  # loaded, computed, finished: one step
    assert [tuple(event.block_hashes) for event in store_events(published)] == [
        tuple(hashes[2 * chunk:2 * chunk + 2]) for chunk in range(3)]
    keys = first.side.store.keys(np.asarray(tokens, dtype=np.uint32), request_salt=load.request_salt)
    store = FileStore(f"{tmp_path}/kv")
    damaged = bytearray(store.get(f"{keys[2]}.g0") or b"")
    damaged[len(damaged) // 2] ^= 0x01
    store.put(f"{keys[2]}.g0", bytes(damaged))
    harness, third, published = one_group(2)
    harness.add("damaged", tokens, max_tokens=1)
    steps, _, _ = harness.admit(third, "damaged")
    assert steps[-1].invalid_blocks  # vLLM recomputes the blocks the load left undefined
    # The step the load failed in announced nothing it read (the recomputed chunks are announced once
    # they are saved again, in later steps), and the corrupt entry removed.
    assert not [event for event in store_events(published) if isinstance(event, BlockStored)]
    harness.step(third)
    (removed,) = [event for event in store_events(published) if isinstance(event, BlockRemoved)]
    assert removed.block_hashes == hashes[4:6]
