"""Loads that start while vLLM's running batch is full (issue 40): ``may_load_async`` against vLLM 0.34's real
Scheduler with ``max_num_inflight_kv_loads``, and its answers on every release (the method exists on the
connector whatever vLLM asks).

A server that saved a conversation, or looked it up, knows its prefix keys: when the conversation comes back
while every running slot is taken, its load starts at once and the request runs with its K/V in place the
step a slot frees. Anything the connector cannot vouch for without asking the store waits for a slot as
before, and a guess the store proves wrong is counted."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import SchedulerConfig

from tests.integrations.vllm.harness import (
    FakeWorker,
    SchedulerHarness,
    Step,
    cache_config,
    file_store,
    prompt,
    token_rows,
    vllm_config,
)
from tests.support.servers import running_server

KINDS = ["sliding", "full"]
BUSY_TOKENS = 12  # decode steps the requests holding every running slot take

needs_inflight_loads = pytest.mark.skipif(
    "max_num_inflight_kv_loads" not in {field.name for field in dataclasses.fields(SchedulerConfig)},
    reason="vLLM before 0.34 starts no load while the running batch is full")


def server(model_dir: Path, extra: dict[str, Any], *, inflight: int | None = 2, prefix_caching: bool = False,
           seed: int = 0, kinds: list[str] = KINDS) -> tuple[SchedulerHarness, FakeWorker]:
    """A scheduler with two running slots (``inflight``: vLLM 0.34's max_num_inflight_kv_loads) and its worker."""
    kv = cache_config(kinds, num_blocks=96)
    config = vllm_config(model_dir, extra, max_num_seqs=2, inflight_kv_loads=inflight, prefix_caching=prefix_caching)
    return SchedulerHarness(config, kv), FakeWorker(config, kv, seed=seed)


def serve(harness: SchedulerHarness, worker: FakeWorker, request_id: str, tokens: list[int]) -> list[Step]:
    harness.add(request_id, tokens)
    return harness.run(worker)


def counters(harness: SchedulerHarness) -> tuple[int, int]:
    counts = harness.connector._scheduler_side().counts
    return counts.early_loads, counts.early_load_misses


def fill_the_batch(harness: SchedulerHarness, worker: FakeWorker) -> list[Step]:
    """Two requests of their own prompts take both running slots and decode for BUSY_TOKENS steps."""
    for index in range(2):
        harness.add(f"busy-{index}", prompt(40, seed=50 + index), max_tokens=BUSY_TOKENS)
    steps = [harness.step(worker)]
    assert set(steps[0].new()) == {"busy-0", "busy-1"}
    return steps


def until_scheduled(harness: SchedulerHarness, worker: FakeWorker, request_ids: set[str],
                    max_steps: int = 40) -> list[Step]:
    steps: list[Step] = []
    while not request_ids <= {request for step in steps for request in step.new()}:
        assert len(steps) < max_steps, f"{request_ids} not scheduled in {max_steps} steps"
        steps.append(harness.step(worker))
    return steps


def first_step(steps: list[Step], request_id: str) -> int:
    return next(index for index, step in enumerate(steps) if request_id in step.new())


def load_step(steps: list[Step], request_id: str) -> int:
    return next(index for index, step in enumerate(steps)
                if any(load.request_id == request_id for load in step.metadata.loads))


@needs_inflight_loads
def test_a_known_prefix_loads_while_the_batch_is_full_and_runs_when_a_slot_frees(gemma3_dir: Path,
                                                                                 tmp_path: Path) -> None:
    tokens = prompt(100)
    for inflight in (None, 2):  # vLLM's default first: loads wait for a slot
        extra = file_store(tmp_path / str(inflight))
        harness, worker = server(gemma3_dir, extra, inflight=inflight)
        (save,) = serve(harness, worker, "first", tokens)[0].metadata.saves
        busy = fill_the_batch(harness, worker)
        harness.add("again", tokens)  # the conversation comes back while both slots are taken
        miss = harness.add("miss", prompt(100, seed=9))  # and a prompt the store never saw, after it
        assert harness.connector.may_load_async(miss) is False
        steps = until_scheduled(harness, worker, {"again", "miss"})
        freed = min(first_step(steps, "miss"), first_step(steps, "again"))
        # Both busy requests decode BUSY_TOKENS tokens: their slots free together, after the prefill step.
        assert len(busy) + freed == BUSY_TOKENS
        loaded = load_step(steps, "again")
        (load,) = [plan for plan in steps[loaded].metadata.loads if plan.request_id == "again"]
        assert (load.num_tokens, load.local_tokens, load.asynchronous) == (96, 0, True)
        assert first_step(steps, "miss") == freed  # never behind the load: scheduled the step a slot frees
        if inflight is None:  # vLLM never asks may_load_async
            assert loaded == freed and first_step(steps, "again") == freed + 1
            assert counters(harness) == (0, 0)
        else:
            # Loaded the step it arrived, while no slot was free; run, its K/V in place, as soon as one is.
            assert loaded == 0 and steps[0].finished_loads == {"again"}
            assert "again" not in steps[0].output.num_scheduled_tokens
            assert first_step(steps, "again") == freed and steps[freed].new()["again"] == 96
            assert counters(harness) == (1, 0)  # its keys saved by this server: no store asked
        # A full-attention layer's 96 tokens, as the first request's step saved them (the fake forward
        # writes nothing: the bytes are the worker's first ones).
        reference = FakeWorker(harness.config, harness.kv_cache_config, seed=0)
        got, want = (token_rows(each, block_ids, range(96))[-1].contiguous().view(torch.uint8)
                      for each, block_ids in ((worker, load.block_ids), (reference, save.block_ids)))
        assert torch.equal(got, want)  # bytes: random ones hold NaNs
        harness.run(worker)


@needs_inflight_loads
def test_a_wrong_guess_is_counted_and_holds_no_miss_back(gemma3_dir: Path, tmp_path: Path) -> None:
    """Entries deleted behind the server's back: its keys still say "stored", the lookup says none. The
    request waits at the head of the early loads (as vLLM's API says of a false positive) and is computed
    when a slot frees, in its arrival order; the miss behind it is scheduled the same step."""
    tokens, extra = prompt(100), file_store(tmp_path)
    harness, worker = server(gemma3_dir, extra)
    serve(harness, worker, "first", tokens)
    for entry in [path for path in (tmp_path / "kv").rglob("*") if path.is_file()]:
        entry.unlink()
    busy = fill_the_batch(harness, worker)
    harness.add("gone", tokens)
    harness.add("miss", prompt(100, seed=9))
    steps = until_scheduled(harness, worker, {"gone", "miss"})
    assert first_step(steps, "gone") == first_step(steps, "miss") == BUSY_TOKENS - len(busy)
    assert steps[-1].new() == {"gone": 0, "miss": 0}
    assert not any(step.metadata.loads for step in steps)
    assert counters(harness) == (1, 1)
    harness.run(worker)


@needs_inflight_loads
def test_what_vllms_own_cache_holds_is_not_an_early_load(gemma3_dir: Path, tmp_path: Path) -> None:
    """With vLLM's prefix cache on, a prompt it still holds gains nothing from the store: no early load (it
    would hold back others), and the request takes its local hit when a slot frees."""
    tokens, extra = prompt(100), file_store(tmp_path)
    harness, worker = server(gemma3_dir, extra, prefix_caching=True)
    serve(harness, worker, "first", tokens)
    busy = fill_the_batch(harness, worker)
    request = harness.add("again", tokens)
    assert harness.scheduler.kv_cache_manager.get_num_cached_tokens(request) == 96
    assert harness.connector.may_load_async(request) is False
    steps = until_scheduled(harness, worker, {"again"})
    assert first_step(steps, "again") == BUSY_TOKENS - len(busy) and steps[-1].new() == {"again": 96}
    assert not any(step.metadata.loads for step in steps) and counters(harness) == (0, 0)


def test_may_load_async_asks_no_store_and_answers_only_what_it_can_vouch_for(gemma3_dir: Path,
                                                                              tmp_path: Path) -> None:
    """Every release (vLLM 0.32 and 0.33 never ask, but the answer is the connector's): a store on a
    server is never asked on the scheduler's thread: the first answer for a prefix this server never saw is
    False while its lookup starts in the background; once that lookup found the prefix, True. P/D transfers
    are True; a request the store may not serve, a prompt shorter than a chunk, and synchronous loads never."""
    tokens = prompt(100)
    with running_server(tmp_path) as redis:
        extra = {"store": redis.url, "chunk_size": 32}
        harness, worker = server(gemma3_dir, extra, inflight=None)  # vLLM never asks: only this test does
        serve(harness, worker, "first", tokens)
        other, _ = server(gemma3_dir, extra, inflight=None)  # another server on the same store: knows nothing
        side = other.connector._scheduler_side()
        asked, answer = [], threading.Event()
        locate = side.rank_stores[0].locate

        def slow_locate(*args: Any, **kwargs: Any) -> Any:  # a server that takes its time
            asked.append(threading.current_thread().name)
            answer.wait(10)
            return locate(*args, **kwargs)

        side.rank_stores[0].locate = slow_locate
        request = other.add("again", tokens)
        assert other.connector.may_load_async(request) is False  # unknown: the lookup runs meanwhile
        answer.set()
        deadline = time.monotonic() + 60  # a loaded machine: the answer, not its speed, is under test
        while side.lookups.known("again") is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert side.lookups.known("again") == 96 and len(asked) == 1 and asked[0].startswith("kvgroups-lookup")
        assert other.connector.may_load_async(request) is True and len(asked) == 1  # the same lookup's answer
        remote = other.add("remote", prompt(100, seed=3), kv_transfer_params={"do_remote_prefill": True})
        assert other.connector.may_load_async(remote) is True
        refused = other.add("refused", tokens, kv_transfer_params={"kvgroups": {"load": False}})
        short = other.add("short", tokens[:32])  # one chunk: its last token must be computed, nothing to load
        assert other.connector.may_load_async(refused) is False and other.connector.may_load_async(short) is False
        # One vLLM group: the only layout where 'sync' is honoured (several groups load asynchronously).
        sync, _ = server(gemma3_dir, {**extra, "load_mode": "sync"}, inflight=None, kinds=["full"])
        assert sync.connector._scheduler_side().asynchronous is False
        assert sync.connector.may_load_async(sync.add("again", tokens)) is False


def test_the_connector_reaches_the_cache_in_process_and_keeps_block_hashes_to_their_own_tokens() -> None:
    """vLLM 0.34's two class-level questions: the extensible KV cache may allocate as it likes (the workers
    copy with torch ops in their own process), and no lookahead block hashing (a chunk's key covers its own
    tokens only, so EAGLE's drafter must not be handed K/V computed before other tokens)."""
    from kvgroups.integrations.vllm import KVGroupsConnector

    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    if not hasattr(kv_transfer, "KVCacheAccess"):
        pytest.skip("vLLM before 0.34 asks neither")
    access = KVGroupsConnector.kv_cache_access(None)
    assert access == kv_transfer.KVCacheAccess.IN_PROCESS and not access.needs_single_chunk()
    assert KVGroupsConnector.supports_lookahead_block_hashes(None) is False
