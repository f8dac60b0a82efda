"""Lookups never wait on entries' bytes, and on a server they run in the background: vLLM is answered None meanwhile."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvgroups.integrations.vllm.lookups import KnownPrefixes, Lookups, all_tiers_local
from tests.integrations.vllm.harness import FakeWorker, SchedulerHarness, cache_config, prompt, vllm_config

CHUNK = 32


def test_only_stores_on_this_machine_are_asked_inline() -> None:
    assert all_tiers_local(["file:///var/cache/kv"])
    assert not all_tiers_local(["file:///var/cache/kv", "redis://cache:6379/0"])
    assert not all_tiers_local(["rediss-cluster://cache:6379"])


def test_an_inline_lookup_is_answered_at_once_and_once() -> None:
    calls: list[str] = []
    lookups = Lookups(background=False)
    assert lookups.answer("a", lambda: calls.append("a") or 96) == 96
    assert lookups.answer("a", lambda: calls.append("again") or 0) == 96
    assert calls == ["a"]
    lookups.forget("a")
    assert lookups.answer("a", lambda: 32) == 32


def test_background_lookups_answer_none_until_done_then_keep_their_answer() -> None:
    release = threading.Event()
    calls: list[str] = []

    def slow(request_id: str, hit: int) -> Any:
        def lookup() -> int:
            calls.append(request_id)
            release.wait(10)
            return hit
        return lookup

    lookups = Lookups(background=True)
    try:
        assert lookups.answer("a", slow("a", 96)) is None
        assert lookups.answer("a", slow("a", 0)) is None  # still running: not started again
        assert lookups.pending == 1
        release.set()
        deadline = time.monotonic() + 10
        while (answer := lookups.answer("a", slow("a", 0))) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert answer == 96 and lookups.pending == 0
        assert lookups.answer("a", slow("a", 0)) == 96
        assert calls == ["a"]
    finally:
        release.set()
        lookups.close()


def test_background_lookups_run_on_a_bounded_pool_and_overflow_as_misses() -> None:
    release = threading.Event()
    running = 0
    most = 0
    lock = threading.Lock()

    def lookup() -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(10)
        with lock:
            running -= 1
        return 64

    lookups = Lookups(background=True, threads=2, max_pending=4)
    try:
        assert [lookups.answer(f"r{index}", lookup) for index in range(6)] == [None] * 4 + [0, 0]
        assert lookups.overflows == 2 and lookups.pending == 4
        time.sleep(0.05)
        assert most == 2  # two threads, whatever is queued
        release.set()
        deadline = time.monotonic() + 10
        while lookups.pending and time.monotonic() < deadline:
            for index in range(4):
                lookups.answer(f"r{index}", lookup)
            time.sleep(0.001)
        assert [lookups.answer(f"r{index}", lookup) for index in range(6)] == [64] * 4 + [0, 0]
        assert most == 2
    finally:
        release.set()
        lookups.close()


def test_a_lookup_started_ahead_is_collected_once_and_inline_ones_never_run_ahead() -> None:
    calls: list[str] = []
    inline = Lookups(background=False)
    inline.start("a", lambda: calls.append("inline") or 5)
    assert inline.known("a") is None and calls == []  # run only when the scheduler asks
    background = Lookups(background=True)
    try:
        background.start("a", lambda: calls.append("background") or 7)
        background.start("a", lambda: calls.append("again") or 0)  # already running: not twice
        deadline = time.monotonic() + 10
        while background.known("a") is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert background.known("a") == 7 and background.answer("a", lambda: 0) == 7 and calls == ["background"]
    finally:
        background.close()


def test_known_prefixes_count_leading_keys_and_forget_the_oldest() -> None:
    known = KnownPrefixes(capacity=3)
    known.add(["k0", "k1"])
    assert known.depth(["k0", "k1", "k2"]) == 2 and known.depth(["k1", "k0"]) == 2 and known.depth(["x", "k0"]) == 0
    known.add(["k2"])
    known.add(["k0"])  # seen again: the newest
    known.add(["k3"])  # over capacity: k1, the oldest, goes
    assert len(known) == 3 and known.depth(["k0"]) == 1 and known.depth(["k1"]) == 0
    assert known.depth(["k2", "k3", "k0"]) == 3
    known.clear()
    assert known.depth(["k0"]) == 0


def test_a_failing_lookup_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> int:
        raise ValueError("boom")

    assert Lookups(background=False).answer("a", broken) == 0
    assert "looking up its prefix failed" in caplog.text


def test_the_scheduler_is_answered_none_while_a_server_lookup_runs(gemma3_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With lookups in the background (as on a server), a waiting request is skipped, not waited for;
    the others are scheduled; it is admitted with its hit once the lookup is done. The scheduler
    never reads an entry's bytes."""
    extra = {"store": f"file://{tmp_path}/kv", "chunk_size": CHUNK}
    kv = cache_config(["sliding", "full"])
    config = vllm_config(gemma3_dir, extra)
    tokens = prompt(100)
    first = FakeWorker(config, kv)
    filler = SchedulerHarness(config, kv)
    filler.add("fill", tokens)
    filler.run(first)
    monkeypatch.setattr("kvgroups.integrations.vllm.scheduler_side.all_tiers_local", lambda urls: False)
    harness, second = SchedulerHarness(config, kv), FakeWorker(config, kv, seed=1)
    scheduler_side = harness.connector._scheduler
    assert scheduler_side.lookups.background
    release = threading.Event()
    lookup = scheduler_side._stored_hit
    calls: list[str] = []

    def held(state: Any, usable: int) -> int:
        calls.append(state.request.request_id)
        if state.request.request_id == "reuse":
            release.wait(10)
        return int(lookup(state, usable))

    monkeypatch.setattr(scheduler_side, "_stored_hit", held)
    harness.add("reuse", tokens)
    harness.add("other", prompt(100, seed=5))
    steps = []
    for _ in range(5):
        steps.append(harness.step(second))
        time.sleep(0.01)
    assert "reuse" not in {request for step in steps for request in step.new()}  # skipped while it runs
    assert any("other" in step.new() for step in steps)  # the others go on
    assert calls.count("reuse") == 1  # asked again each step, looked up once
    release.set()
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 96 and load.num_tokens == 96
    assert calls.count("reuse") == 1
    assert all(store.stats.bytes_read == [0, 0] for store in scheduler_side.rank_stores)
    harness.run(second)
    assert not harness.scheduler.requests
