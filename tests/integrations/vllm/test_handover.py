"""Disaggregated prefill through the store (issue 41), against vLLM's real Scheduler with fake caches: a
prefill server (``kv_producer``) answers a ``do_remote_decode`` request with the hand-over in its
``kv_transfer_params``; a decode server (``kv_consumer``) given them loads every whole chunk, waits for
entries still being written without holding its scheduler, and computes what never arrives."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgroups.integrations.vllm.handover import HANDOVER_KEY
from kvgroups.integrations.vllm.settings import ConnectorConfigError, ConnectorSettings
from tests.integrations.vllm.harness import (
    FakeWorker,
    SchedulerHarness,
    cache_config,
    file_store,
    prompt,
    token_rows,
    vllm_config,
)

KINDS = ["sliding", "full"]
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def server(model_dir: Path, extra: dict[str, Any], role: str, seed: int) -> tuple[SchedulerHarness, FakeWorker]:
    kv = cache_config(KINDS)
    config = vllm_config(model_dir, extra, role=role)
    return SchedulerHarness(config, kv), FakeWorker(config, kv, seed=seed)


def prefill(model_dir: Path, extra: dict[str, Any], tokens: list[int]) -> tuple[dict[str, Any], Any, FakeWorker]:
    """The prefill server's answer to a P/D request: its response's kv_transfer_params, its save, its worker."""
    harness, worker = server(model_dir, extra, "kv_producer", seed=0)
    harness.add("p", tokens, max_tokens=1, kv_transfer_params=dict(PREFILL))
    steps = harness.run(worker)
    (params,) = [step.kv_transfer_params["p"] for step in steps if "p" in step.kv_transfer_params]
    (save,) = [save for step in steps for save in step.metadata.saves]
    return params, save, worker


def counts(harness: SchedulerHarness) -> tuple[int, int, int]:
    side = harness.connector._scheduler_side().counts
    return side.handovers_received, side.handover_tokens, side.handover_waits_expired


def test_the_decode_server_loads_every_chunk_the_prefill_server_saved(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens, extra = prompt(100), file_store(tmp_path)
    params, save, prefilled = prefill(gemma3_dir, extra, tokens)
    handover = params[HANDOVER_KEY]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert handover["tokens"] == 96 and handover["world_size"] == 1 and time.time() - handover["finished_at"] < 60
    decode, worker = server(gemma3_dir, extra, "kv_consumer", seed=1)
    decode.add("d", tokens, kv_transfer_params=params)
    steps, computed, load = decode.admit(worker, "d")
    assert computed == 96 and (load.num_tokens, load.asynchronous) == (96, True)
    got, want = (token_rows(each, block_ids, range(96))[-1].contiguous().view(torch.uint8)
                 for each, block_ids in ((worker, load.block_ids), (prefilled, save.block_ids)))
    assert torch.equal(got, want)
    assert counts(decode) == (1, 96, 0)
    steps += decode.run(worker)
    assert not any(step.metadata.saves for step in steps)  # a consumer never saves
    assert decode.connector._scheduler_side().counts.handover_delay_ms >= 0


def test_entries_still_being_written_are_waited_for_without_holding_the_scheduler(gemma3_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """The decode request arrives before the prefill's entries: its lookup answers "ask again", other
    requests run meanwhile, and once the entries land it loads all of them."""
    tokens, extra = prompt(100), file_store(tmp_path, handover_wait_seconds=30)
    early = {**PREFILL, "do_remote_prefill": True, "do_remote_decode": False,
             HANDOVER_KEY: {"tokens": 96, "finished_at": time.time(), "world_size": 1}}
    decode, worker = server(gemma3_dir, extra, "kv_consumer", seed=1)
    decode.add("d", tokens, kv_transfer_params=early)
    decode.add("other", prompt(50, seed=4), max_tokens=3)
    waited = []
    for _ in range(6):
        waited.append(decode.step(worker))
        time.sleep(0.03)
    assert "d" not in {request for step in waited for request in step.new()}
    assert "other" in waited[0].new()  # the scheduler went on
    prefill(gemma3_dir, extra, tokens)
    computed = decode.admit(worker, "d")[1]
    assert computed == 96 and counts(decode) == (1, 96, 0)


def test_entries_that_never_arrive_are_computed_once_the_wait_runs_out(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens, extra = prompt(100), file_store(tmp_path, handover_wait_seconds=0.3)
    params, _, _ = prefill(gemma3_dir, extra, tokens)
    for entry in [path for path in (tmp_path / "kv").rglob("*") if path.is_file() and path.parent != tmp_path / "kv"]:
        entry.unlink()  # the prefill server's entries (in the store's shard directories) deleted, or never written
    decode, worker = server(gemma3_dir, extra, "kv_consumer", seed=1)
    decode.add("d", tokens, kv_transfer_params=params)
    started = time.monotonic()
    computed, load = decode.admit(worker, "d")[1:]
    assert computed == 0 and load is None and 0.3 <= time.monotonic() - started < 10
    assert counts(decode) == (1, 0, 1)
    decode.run(worker)
    assert not decode.scheduler.has_unfinished_requests()  # answered


@pytest.mark.parametrize(("handover", "reason"), [
    ({"tokens": 96, "finished_at": 1.0, "world_size": 2}, "its prefill server ran 2 tensor-parallel ranks, this one 1"),
    ({"tokens": 10**9, "finished_at": 1.0, "world_size": 1}, "'tokens' must be an int from 0 to the prompt's 100"),
    ({"tokens": 96, "finished_at": "soon", "world_size": 1}, "'finished_at' must be a finite number"),
    ("96", "must be {'tokens': int, 'finished_at': float, 'world_size': int}"),
])
def test_a_hand_over_this_server_cannot_load_is_computed_and_said(gemma3_dir: Path, tmp_path: Path, handover: Any,
                                                                  reason: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    tokens, extra = prompt(100), file_store(tmp_path, handover_wait_seconds=30)
    prefill(gemma3_dir, extra, tokens)
    decode, worker = server(gemma3_dir, extra, "kv_consumer", seed=1)
    decode.add("d", tokens, kv_transfer_params={"do_remote_prefill": True, HANDOVER_KEY: handover})
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        computed = decode.admit(worker, "d")[1]
    assert time.monotonic() - started < 10 and reason in caplog.text
    # No wait: an ordinary request, served what the store holds (here the prefill's chunks, of one rank).
    assert computed == 96 and counts(decode)[1:] == (0, 0)


def test_roles_a_producer_never_loads_a_consumer_never_saves(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens, extra = prompt(100), file_store(tmp_path)
    prefill(gemma3_dir, extra, tokens)
    producer, worker = server(gemma3_dir, extra, "kv_producer", seed=2)
    producer.add("again", tokens, kv_transfer_params={"do_remote_prefill": True})
    assert producer.admit(worker, "again")[1] == 0
    consumer, other = server(gemma3_dir, extra, "kv_consumer", seed=3)
    consumer.add("new", prompt(100, seed=7))
    assert not any(step.metadata.saves for step in consumer.run(other))


def test_the_wait_is_a_setting_within_bounds() -> None:
    assert ConnectorSettings.from_extra_config({"store": "file:///x"}).handover_wait_seconds == 2.0
    assert ConnectorSettings.from_extra_config({"store": "file:///x", "handover_wait_seconds": 0}) \
        .handover_wait_seconds == 0.0
    for bad in (-1, 601, "2", float("nan")):
        with pytest.raises(ConnectorConfigError, match="'handover_wait_seconds' must be a number from 0 to 600"):
            ConnectorSettings.from_extra_config({"store": "file:///x", "handover_wait_seconds": bad})


def test_chunks_vllm_s_own_cache_served_the_prefill_server_are_handed_over_too(gemma3_dir: Path,
                                                                              tmp_path: Path) -> None:
    """A system prompt the prefill server computed before comes from vLLM's prefix cache, so no step of
    this request saves it; it is in the store all the same (the earlier request saved it), and the
    hand-over names it: the decode server waits for, and loads, the whole prompt."""
    system, extra = prompt(64), file_store(tmp_path)
    kv = cache_config(["full"])
    config = vllm_config(gemma3_dir, extra, role="kv_producer", prefix_caching=True)
    harness, worker = SchedulerHarness(config, kv), FakeWorker(config, kv, seed=0)
    harness.add("first", system + prompt(36, seed=5), max_tokens=1)
    harness.run(worker)
    tokens = system + prompt(36, seed=6)
    harness.add("p", tokens, max_tokens=1, kv_transfer_params=dict(PREFILL))
    steps = harness.run(worker)
    assert steps[0].new()["p"] == 64  # vLLM's cache served the system prompt
    assert [save.chunks for step in steps for save in step.metadata.saves] == [(2,)]
    (params,) = [step.kv_transfer_params["p"] for step in steps if "p" in step.kv_transfer_params]
    assert params[HANDOVER_KEY]["tokens"] == 96
    decode = SchedulerHarness(vllm_config(gemma3_dir, extra, role="kv_consumer"), kv)
    decode.add("d", tokens, kv_transfer_params=params)
    computed = decode.admit(FakeWorker(config, kv, seed=1), "d")[1]
    assert computed == 96 and counts(decode) == (1, 96, 0)


def test_two_tensor_parallel_ranks_on_both_sides_hand_over_each_rank_s_chunks(gemma3_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Prefill and decode of the same tensor-parallel size: each decode rank loads, byte for byte, what the
    prefill server's rank of the same index saved (each rank's heads are its own; sliding-window tokens
    outside the window are neither saved nor loaded, so the full-attention group is compared)."""
    tokens, extra, kv = prompt(100), file_store(tmp_path), cache_config(KINDS)
    producer = vllm_config(gemma3_dir, extra, role="kv_producer", tp=2)
    prefilled = tuple(FakeWorker(producer, kv, seed=seed, rank=rank) for rank, seed in ((0, 0), (1, 5)))
    harness = SchedulerHarness(producer, kv)
    harness.add("p", tokens, max_tokens=1, kv_transfer_params=dict(PREFILL))
    steps = harness.run(prefilled)
    (params,) = [step.kv_transfer_params["p"] for step in steps if "p" in step.kv_transfer_params]
    (save,) = [save for step in steps for save in step.metadata.saves]
    assert (params[HANDOVER_KEY]["tokens"], params[HANDOVER_KEY]["world_size"]) == (96, 2)
    consumer = vllm_config(gemma3_dir, extra, role="kv_consumer", tp=2)
    decode = SchedulerHarness(consumer, kv)
    workers = tuple(FakeWorker(consumer, kv, seed=seed, rank=rank) for rank, seed in ((0, 1), (1, 2)))
    decode.add("d", tokens, kv_transfer_params=params)
    computed, load = decode.admit(workers, "d")[1:]
    assert computed == 96 and counts(decode) == (1, 96, 0)
    for worker, filled in zip(workers, prefilled, strict=True):  # the full-attention group's every token
        got, want = (token_rows(each, block_ids, range(96))[-1].contiguous().view(torch.uint8)
                     for each, block_ids in ((worker, load.block_ids), (filled, save.block_ids)))
        assert torch.equal(got, want)
    assert not torch.equal(*(token_rows(each, save.block_ids, range(96))[-1] for each in prefilled))  # ranks differ


def test_a_nixl_proxy_s_prefill_request_gets_a_hand_over(gemma3_dir: Path, tmp_path: Path) -> None:
    """vLLM's example P/D proxies ask the prefill server with NIXL's fields beside do_remote_decode, empty."""
    nixl = {**PREFILL, "remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None}
    harness, worker = server(gemma3_dir, file_store(tmp_path), "kv_producer", seed=0)
    harness.add("p", prompt(100), max_tokens=1, kv_transfer_params=nixl)
    (params,) = [step.kv_transfer_params["p"] for step in harness.run(worker) if "p" in step.kv_transfer_params]
    assert params[HANDOVER_KEY]["tokens"] == 96 and params["do_remote_prefill"] is True


@pytest.mark.parametrize(("max_batched", "handed"), [(256, 0), (32, 96)])
def test_a_hybrid_hands_over_up_to_the_last_chunk_its_states_were_saved_at(gemma3_dir: Path, tmp_path: Path,
                                                                           max_batched: int, handed: int) -> None:
    """vLLM's prefix cache off (no "align" mode): a recurrent state is kept only where a step ends on a
    chunk's end. A prefill in one step keeps none, so nothing is handed over and the decode server computes
    the prompt at once (no wait for states that never come); steps of one chunk keep every one, and the
    decode server loads the whole prompt's chunks, the state at their end with them."""
    tokens, extra = prompt(100), file_store(tmp_path, handover_wait_seconds=30)
    kv = cache_config(["mamba", "full"])
    producer = vllm_config(gemma3_dir, extra, role="kv_producer", max_batched=max_batched)
    harness, prefilled = SchedulerHarness(producer, kv), FakeWorker(producer, kv, seed=0)
    harness.add("p", tokens, max_tokens=1, kv_transfer_params=dict(PREFILL))
    steps = harness.run(prefilled)
    (params,) = [step.kv_transfer_params["p"] for step in steps if "p" in step.kv_transfer_params]
    assert params[HANDOVER_KEY]["tokens"] == handed
    consumer = vllm_config(gemma3_dir, extra, role="kv_consumer")
    decode = SchedulerHarness(consumer, kv)
    decode.add("d", tokens, kv_transfer_params=params)
    started = time.monotonic()
    computed = decode.admit(FakeWorker(consumer, kv, seed=1), "d")[1]
    assert computed == handed and time.monotonic() - started < 10  # never the 30 s wait
    assert counts(decode) == (1, handed, 0)
