"""The worker's copies as a CUDA engine needs them, checked where a CPU can show it (issue 26): a load is
reported only once its copies completed, loads launch on the load stream from the load threads and saves
on the save stream after the engine's work, and nothing on the path of ``wait_for_save`` synchronizes."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgroups.datapath.descriptors import Launched
from kvgroups.datapath.streams import DONE, CopyStream
from kvgroups.integrations.vllm import KVGroupsConnector
from kvgroups.integrations.vllm.loads import BackgroundLoads
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata
from kvgroups.transfer import KVTransfer
from tests.integrations.vllm.harness import (
    ENGINE_LAYOUT,
    FakeWorker,
    SchedulerHarness,
    cache_config,
    prompt,
    vllm_config,
)
from tests.support.helpers import Pending

CHUNK = 32


def test_a_load_is_reported_only_once_its_copies_completed() -> None:
    loads = BackgroundLoads(bytearray, threads=1)
    copies, failed_copies = Pending(), Pending()
    loads.submit("hit", lambda buffer: (True, copies))
    loads.submit("gone", lambda buffer: (False, failed_copies))
    with loads._lock:  # the jobs returned; their copies have not completed
        assert loads._idle.wait_for(lambda: loads._running == 0, 10)
    assert loads.take() == (set(), set())  # returned is not done: the blocks may still be written
    copies.done.set()
    assert loads.take() == ({"hit"}, set())
    failed_copies.done.set()  # a failed load's partial copies too, before vLLM frees its blocks
    assert loads.take() == ({"gone"}, {"gone"})
    loads.submit("raised", lambda buffer: (_ for _ in ()).throw(RuntimeError("store broke")))
    loads.wait(timeout=10)
    assert loads.take() == ({"raised"}, {"raised"})
    loads.close()


def test_a_step_that_computes_nothing_waits_for_a_load_not_longer() -> None:
    """An engine whose every request waits for a load would otherwise loop on empty steps as fast as it
    can (holding the interpreter's lock the loading thread needs): such a step waits until a load ends,
    at most a bounded time, and returns at once when one has."""
    from kvgroups.integrations.vllm.worker_side import IDLE_WAIT_SECONDS

    loads = BackgroundLoads(bytearray, threads=1)
    release = threading.Event()

    def slow(buffer: Any) -> tuple[bool, Any]:
        release.wait(10)
        return True, DONE

    loads.submit("slow", slow)
    begin = time.perf_counter()
    loads.wait_for_one(IDLE_WAIT_SECONDS)  # nothing ends: the bound
    assert IDLE_WAIT_SECONDS * 0.9 <= time.perf_counter() - begin < IDLE_WAIT_SECONDS + 1
    threading.Timer(0.01, release.set).start()
    begin = time.perf_counter()
    loads.wait_for_one(10)  # ends as soon as the load does
    assert time.perf_counter() - begin < 5 and loads.take() == ({"slow"}, set())
    begin = time.perf_counter()
    loads.wait_for_one(10)  # no load runs: at once
    assert time.perf_counter() - begin < 1
    loads.close()


def test_the_plans_say_when_a_step_computes_nothing(gemma3_dir: Path, tmp_path: Path) -> None:
    extra = {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK}
    kv = cache_config(["sliding", "full"])
    config = vllm_config(gemma3_dir, extra)
    first = FakeWorker(config, kv, seed=0)
    filler = SchedulerHarness(config, kv)
    filler.add("fill", prompt(100))
    assert not filler.run(first)[0].metadata.idle
    harness = SchedulerHarness(config, kv)
    harness.add("reuse", prompt(100))
    steps, _, load = harness.admit(FakeWorker(config, kv, seed=1), "reuse")
    assert load.asynchronous and steps[0].metadata.idle and not steps[-1].metadata.idle


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """Every (stream, thread, what) launch the worker makes, recorded on CopyStream's own methods."""
    recorded: list[tuple[str, str, str]] = []
    @contextlib.contextmanager
    def launching(self: CopyStream, *, after_engine: bool = False) -> Iterator[None]:
        what = "launch after the engine's work" if after_engine else "launch"
        recorded.append((self.name, threading.current_thread().name, what))
        yield

    def record(self: CopyStream) -> Any:
        recorded.append((self.name, threading.current_thread().name, "record"))
        return DONE

    def before_engine(self: CopyStream, completion: Any) -> None:
        recorded.append((self.name, threading.current_thread().name, "the engine waits"))

    monkeypatch.setattr(CopyStream, "name", property(lambda self: getattr(self, "_name", "?")), raising=False)
    monkeypatch.setattr(CopyStream, "launching", launching)
    monkeypatch.setattr(CopyStream, "record", record)
    monkeypatch.setattr(CopyStream, "before_engine", before_engine)
    return recorded


def test_loads_and_saves_launch_on_their_own_streams_and_never_synchronize(
        gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        launches: list[tuple[str, str, str]]) -> None:
    def no_synchronize(self: Launched, synchronize: bool) -> None:
        raise AssertionError("a copy synchronized or recorded an event of its own on the way of wait_for_save or "
                             "a load")

    extra = {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK}
    kv = cache_config(["sliding", "full"])
    config = vllm_config(gemma3_dir, extra)
    first = FakeWorker(config, kv, layout=ENGINE_LAYOUT, seed=0)
    second = FakeWorker(config, kv, layout=ENGINE_LAYOUT, seed=1)
    for worker in (first, second):
        worker.side.load_stream._name, worker.side.save_stream._name = "load", "save"  # type: ignore[attr-defined]
    # Registered (its warm-up may wait): from here on, what pack(out=) and unpack called to wait must not run.
    monkeypatch.setattr(Launched, "release", no_synchronize)
    launches.clear()
    harness = SchedulerHarness(config, kv)
    harness.add("fill", prompt(100))
    harness.run(first)
    engine = threading.current_thread().name
    saves = [launch for launch in launches if launch[0] == "save"]
    # Each step's chunks: on the save stream, ordered after the engine's work, then one event for the writer;
    # after them the engine's stream waits for them (the next forward may rewrite blocks they read).
    per_step = [("save", engine, "launch after the engine's work"), ("save", engine, "record"),
                ("save", engine, "the engine waits")]
    assert saves and saves == per_step * (len(saves) // 3)
    launches.clear()
    fresh = SchedulerHarness(config, kv)
    fresh.add("reuse", prompt(100))
    _, computed, load = fresh.admit(second, "reuse")
    assert computed == 96 and load.asynchronous
    loads = [launch for launch in launches if launch[0] == "load"]
    # The load ran in a load thread, inside the load stream (where the caches' device is made current): its 4
    # entries (sliding: 1 chunk, full: 3) read into buffers, then copied together, and one event after them,
    # which says when the load is done and its buffers may be refilled.
    assert loads == [("load", loads[0][1], "launch"), ("load", loads[0][1], "record")]
    assert loads[0][1].startswith("kvgroups-load")


def test_sleep_drops_every_binding_and_wake_up_binds_again(gemma3_dir: Path, tmp_path: Path) -> None:
    """vLLM 0.33's sleep mode (unregister_kv_caches / restore_kv_caches), as its GPU worker calls the hooks."""
    assert KVGroupsConnector.supports_sleep_mode(None)
    extra = {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK}
    kv = cache_config(["sliding", "full"])
    config = vllm_config(gemma3_dir, extra)
    filler = SchedulerHarness(config, kv)
    filler.add("fill", prompt(100))
    filler.run(FakeWorker(config, kv, layout=ENGINE_LAYOUT, seed=0))
    worker = FakeWorker(config, kv, layout=ENGINE_LAYOUT, seed=1)
    worker.side.unregister()
    worker.side.unregister()  # idempotent, as vLLM asks
    assert worker.side.transfers == [] and worker.side.load_transfers == []
    harness = SchedulerHarness(config, kv)
    harness.add("asleep", prompt(100))
    steps, _, _ = harness.admit(worker, "asleep")
    assert {"asleep"} in [step.failed_loads for step in steps]  # nothing written: vLLM recomputes it
    worker.side.restore()
    worker.side.restore()
    assert len(worker.side.transfers) == 2
    harness.add("awake", prompt(100))
    steps, computed, _ = harness.admit(worker, "awake")
    assert computed == 96 and not any(step.failed_loads for step in steps)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton missing")
def test_a_step_of_several_requests_launches_once_per_group_and_direction(
        gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        launches: list[tuple[str, str, str]]) -> None:
    """Three requests of up to three chunks each, in the two groups of a sliding-window model, saved in one
    step, and their hits loaded in one step (synchronously: vLLM's scheduler plans them asynchronously for this
    model, the worker is handed them as one step's synchronous loads): one Triton launch per group and
    direction, one ``wait_stream`` and one event for each; the loading worker's blocks then hold the bytes the
    saving worker's did."""
    monkeypatch.setenv("KVGROUPS_KERNEL", "triton")  # as on a GPU (its interpreter here)
    extra = {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK}
    kv = cache_config(["sliding", "full"])
    config = vllm_config(gemma3_dir, extra)
    counted: list[tuple[int, bool]] = []  # (group, scatter) of every launch
    workers = []
    for seed in (0, 1, 2):
        worker = FakeWorker(config, kv, layout=ENGINE_LAYOUT, seed=seed)
        worker.side.load_stream._name, worker.side.save_stream._name = "load", "save"  # type: ignore[attr-defined]
        assert [transfer.kernels for transfer in worker.side.transfers] == [["triton"], ["triton"]]
        for member, transfer in enumerate(worker.side.transfers):
            copier = transfer._copiers[0]
            real = copier.launch  # type: ignore[union-attr]

            def count(kernel: Any, grid: Any, arguments: Any, constants: Any, member: int = member,
                      real: Any = real) -> None:
                counted.append((member, constants["scatter"]))
                real(kernel, grid, arguments, constants)
            copier.launch = count  # type: ignore[union-attr]
        workers.append(worker)
    saving, planning, loading = workers
    harness = SchedulerHarness(config, kv)
    for index in range(3):
        harness.add(f"fill-{index}", prompt(100, seed=index))
    launches.clear()
    first = harness.step(saving)
    saved = {plan.request_id: plan for plan in first.metadata.saves}
    assert sorted(saved) == ["fill-0", "fill-1", "fill-2"] and sum(len(plan.chunks) for plan in saved.values()) >= 7
    assert sorted(counted) == [(0, False), (1, False)]
    engine = threading.current_thread().name
    assert [launch for launch in launches if launch[0] == "save"] == [
        ("save", engine, "launch after the engine's work"), ("save", engine, "record"),
        ("save", engine, "the engine waits")]
    # Each request's blocks as its last save saw them (one not wholly prefilled in the first step has more later).
    blocks_of = {plan.request_id: plan.block_ids for step in [first, *harness.run(saving)]
                 for plan in step.metadata.saves}

    reuse = SchedulerHarness(config, kv)
    for index in range(3):
        reuse.add(f"reuse-{index}", prompt(100, seed=index))
    planned: dict[str, Any] = {}
    for _ in range(200):
        planned.update({plan.request_id: plan for plan in reuse.step(planning).metadata.loads})
        if len(planned) == 3:
            break
        time.sleep(0.005)  # a lookup runs in the background
    plans = [planned[f"reuse-{index}"] for index in range(3)]
    assert all(plan.num_tokens == 96 for plan in plans)
    for group in (0, 1):  # three live requests: no block of one is another's
        blocks = [block for plan in plans for block in plan.block_ids[group] if block]
        assert len(blocks) == len(set(blocks))
    counted.clear()
    launches.clear()
    byte_store = loading.side.store.store  # type: ignore[union-attr]
    batches: list[int] = []
    asked = byte_store.get_many_into
    byte_store.get_many_into = lambda keys, buffers: batches.append(len(keys)) or asked(keys, buffers)  # type: ignore[method-assign]
    loading.side.load(KVGroupsConnectorMetadata(loads=[replace(plan, asynchronous=False) for plan in plans]))
    # Each request's entries asked of the store in one batch (a server's round trip), not one call per entry.
    assert len(batches) == len(plans) and all(count >= 2 for count in batches)
    assert sorted(counted) == [(0, True), (1, True)]
    assert [launch for launch in launches if launch[0] == "load"] == [
        ("load", engine, "launch"), ("load", engine, "record"), ("load", engine, "the engine waits")]
    assert loading.side.take_load_errors() == set()
    # The blocks the loads wrote hold the saving worker's bytes: the full group's six blocks of the 96 tokens,
    # and the sliding group's last one (its window, which is all a hit restores there).
    for plan in plans:
        fill = blocks_of[plan.request_id.replace("reuse", "fill")]
        for group, blocks in ((0, [5]), (1, range(6))):
            name = kv.kv_cache_groups[group].layer_names[0]
            for block in blocks:
                source, target = fill[group][block], plan.block_ids[group][block]
                assert torch.equal(loading.caches[name][target].view(torch.uint8),  # random bytes: NaNs among them
                                   saving.caches[name][source].view(torch.uint8)), (
                    plan.request_id, group, block, source, target)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton missing")
def test_a_launch_that_fails_costs_its_saves_and_loads_never_the_engine(
        gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver error launching one group's copies: that step's chunks are not written (a chunk's entries go
    together, and that group's buffers were never filled), and a step's loads all fail (vLLM recomputes them);
    the engine goes on, and the next steps copy as before."""
    monkeypatch.setenv("KVGROUPS_KERNEL", "triton")
    extra = {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK}
    kv = cache_config(["sliding", "full"])
    config = vllm_config(gemma3_dir, extra)
    saving, planning, loading = (FakeWorker(config, kv, layout=ENGINE_LAYOUT, seed=seed) for seed in (0, 1, 2))
    broken = {"on": True}

    def failing(transfer: KVTransfer) -> None:
        copier = transfer._copiers[0]
        real = copier.launch  # type: ignore[union-attr]

        def launch(*arguments: Any) -> None:
            if broken["on"]:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            real(*arguments)
        copier.launch = launch  # type: ignore[union-attr]

    failing(saving.side.transfers[1])  # the full group's saves
    harness = SchedulerHarness(config, kv)
    harness.add("fill", prompt(100))
    harness.step(saving)  # the engine goes on
    saving.side.flush()
    store = saving.side.store
    assert store is not None
    assert list(store.store.iter_keys()) == []  # nothing of the step: no entry of unfilled buffers
    broken["on"] = False
    harness.run(saving)

    # The next prompt is saved whole; then one group's load copies fail.
    other = SchedulerHarness(config, kv)
    other.add("fill-2", prompt(100, seed=1))
    other.run(saving)
    assert all(store.store.contains(store.entry_key(key, 1)) for key in store.keys(prompt(100, seed=1)))
    reuse = SchedulerHarness(config, kv)
    reuse.add("reuse", prompt(100, seed=1))
    plan = None
    for _ in range(200):
        plans = reuse.step(planning).metadata.loads
        if plans:
            plan = plans[0]
            break
        time.sleep(0.005)
    assert plan is not None and plan.num_tokens == 96
    failing(loading.side.transfers[1])
    broken["on"] = True
    loading.side.load(KVGroupsConnectorMetadata(loads=[replace(plan, asynchronous=False)]))
    assert loading.side.take_load_errors()  # vLLM recomputes the blocks it would have read
    broken["on"] = False
    loading.side.load(KVGroupsConnectorMetadata(loads=[replace(plan, asynchronous=False)]))
    assert loading.side.take_load_errors() == set()
