"""The soak's report (benchmarks/soak/report.py) on outcomes made up here: each invariant it holds breaks
the run when broken, and a clean run passes."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks.soak.faults import file_kind, resources
from benchmarks.soak.report import Outcome, SoakReport, by_fault
from kvgroups.store import FileStore

LOADED = {"vllm:kvgroups_loaded_tokens_total{}": 640.0, "vllm:external_prefix_cache_hits_total{}": 640.0}
FAULT = {"fault": "master killed", "what": "a master killed", "start": 30.0, "end": 40.0}


def steady_run(tmp_path: Path) -> tuple[list[Outcome], dict[str, list[dict[str, Any]]]]:
    """One request a second for 80 s, 300 of 400 prompt tokens from caches, but for 30-40 s (none)."""
    outcomes = [Outcome("llama", started=float(at), seconds=0.2, ok=True, prompt_tokens=400,
                        cached_tokens=0 if 30 <= at < 40 else 300, incarnation=1) for at in range(80)]
    samples = {"llama": [{"time": float(at), "incarnation": 1, "rss": 1000, "threads": 10, "files": 20,
                          "tier_bytes": 100, "connector": counts(loaded=at * 8.0, external=at * 10.0)}
                         for at in range(0, 80, 4)],
               "cluster": [{"time": 1.0, "used": 10}]}
    return outcomes, samples


def counts(loaded: float, external: float) -> dict[str, float]:
    """A sample's connector counters (benchmarks.soak.report.CONNECTOR_COUNTERS)."""
    return {"loaded": loaded, "external hits": external, "short loads": 0.0, "failed reads": 0.0,
            "corrupt entries": 0.0, "tier errors": 0.0}


def write(tmp_path: Path, outcomes: list[Outcome], samples: dict[str, list[dict[str, Any]]],
          metrics: dict[str, dict[str, float]] | None = None, interrupted_at: float | None = None) -> dict[str, Any]:
    arguments = argparse.Namespace(timeout=120.0, minutes=80 / 60, clients=1, json=str(tmp_path / "soak.json"))
    cached = sum(outcome.cached_tokens for outcome in outcomes if outcome.ok)
    metrics = metrics if metrics is not None else {"llama": {"vllm:prompt_tokens_cached_total{}": float(cached),
                                                             **LOADED}}
    status = SoakReport(outcomes, samples, [dict(FAULT)], 0.0, arguments, [], tier_budget_bytes=1000,
                        cluster_maxmemory=100, interrupted_at=interrupted_at).write(metrics)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert status == (1 if result["problems"] else 0)
    return dict(result)


def test_a_clean_run_passes_and_says_when_hits_came_back(tmp_path: Path) -> None:
    result = write(tmp_path, *steady_run(tmp_path))
    assert result["problems"] == []
    (row,) = result["faults"]
    assert row["requests"] == 10  # sent at 30, 31, ... 39 s
    assert row["hits back after s"] == pytest.approx(7.0)  # 40..47: eight in a row served as before
    assert row["store hit tokens"] == 440  # the counter sampled at 32, 36, ... 76 s: up 10 a second


@pytest.mark.parametrize(("change", "problem"), [
    (lambda o, s: o.append(Outcome("llama", 35.0, 1.0, ok=False, error="refused", incarnation=1)),
     "master killed: 1 requests failed (refused)"),
    (lambda o, s: setattr(o[33], "differs", True), "master killed: 1 answers differ from the computed ones"),
    (lambda o, s: [setattr(each, "cached_tokens", 0) for each in o[40:]],
     "master killed: caches did not serve 0.60 of prompts within 40 requests after it ended"),
    (lambda o, s: o.__delitem__(slice(45, None)),
     "master killed: hits' return not measured: 5 requests answered between its end and the next fault, 8 needed"),
    (lambda o, s: setattr(o[50], "seconds", 121.0), "1 requests took longer than 120.0 s"),
    (lambda o, s: setattr(o[5], "reference_cached_tokens", 64),
     "1 computed answers (a fresh cache salt, the store off) were served 64 tokens from a cache"),
    (lambda o, s: [sample.update(rss=100 << 20) for sample in s["llama"]] + [
        sample.update(rss=140 << 20) for sample in s["llama"][15:]],
     "llama: rss grew 1.400x (+41943040) from the second quarter to the last"),
    (lambda o, s: s["llama"][3].update(tier_bytes=2000), "llama's file tier held 2000 bytes, over its budget of 1000"),
    (lambda o, s: s["cluster"].append({"time": 2.0, "used": 200}),
     "a cluster master held 200 bytes, over its maxmemory 100"),
    (lambda o, s: s["llama"].__delitem__(slice(11, None)),
     "llama: 11 samples of its longest run, too few to tell its resources flat (12 needed)"),
])
def test_each_broken_invariant_fails_the_run(tmp_path: Path, change: Any, problem: str) -> None:
    outcomes, samples = steady_run(tmp_path)
    cached = sum(outcome.cached_tokens for outcome in outcomes)
    change(outcomes, samples)
    result = write(tmp_path, outcomes, samples, {"llama": {"vllm:prompt_tokens_cached_total{}": float(
        sum(outcome.cached_tokens for outcome in outcomes if outcome.ok) if "caches did not" in problem else cached),
        **LOADED}})
    assert problem in result["problems"], result["problems"]


def test_a_few_more_files_are_not_a_leak(tmp_path: Path) -> None:
    outcomes, samples = steady_run(tmp_path)
    for sample in samples["llama"][15:]:
        sample["files"] = 35  # 20 before: 1.75x, but 15 more
    result = write(tmp_path, outcomes, samples)
    assert result["problems"] == [] and result["flat"]["llama"]["files"] == 1.75


def test_shard_directories_opened_as_the_store_fills_are_not_a_leak_but_more_than_it_has_are(tmp_path: Path) -> None:
    outcomes, samples = steady_run(tmp_path)
    for index, sample in enumerate(samples["llama"]):
        sample.update(shard_directories=12 * index, most_shard_directories=min(256, 12 * index))
    assert write(tmp_path, outcomes, samples)["problems"] == []
    samples["llama"][-1]["most_shard_directories"] = 257  # all kept, and the one a scan has open
    assert write(tmp_path, outcomes, samples)["problems"] == []
    samples["llama"][-1]["most_shard_directories"] = 259
    assert write(tmp_path, outcomes, samples)["problems"] == [
        "a process of llama held 259 descriptors of its file tier's shard directories; the store keeps at most 256, "
        "and a scan lists one more"]


def test_files_that_grow_say_which_kind_grew(tmp_path: Path) -> None:
    outcomes, samples = steady_run(tmp_path)
    for index, sample in enumerate(samples["llama"]):
        sample.update(files=20 + 40 * (index >= 15), file_kinds={"pipe": 10, "socket": 10 + 40 * (index >= 15)})
    assert write(tmp_path, outcomes, samples)["problems"] == [
        "llama: files grew 3.000x (+40) from the second quarter to the last: socket +40"]


def test_resources_count_a_stores_shard_directories_apart(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "kv")
    for index in range(40):
        store.put(f"key-{index}", b"value")
    shards = len([entry for entry in (tmp_path / "kv").iterdir() if entry.is_dir()])
    held = resources(os.getpid(), tmp_path / "kv")
    store.close()
    after = resources(os.getpid(), tmp_path / "kv")
    assert 16 < shards <= 40 and held["shard_directories"] == held["most_shard_directories"] == shards
    assert after["shard_directories"] == 0 and after["files"] == held["files"]
    assert file_kind("socket:[123]", "/x") == "socket" and file_kind("/x/ab", "/x") == "shard directory"
    assert file_kind("/x/ab/cd.kve", "/x") == "file" and file_kind("anon_inode:[eventfd]", "/x") == "anon"


def test_a_run_whose_store_served_nothing_fails(tmp_path: Path) -> None:
    outcomes, samples = steady_run(tmp_path)
    for sample in samples["llama"]:
        sample["connector"] = counts(loaded=0.0, external=0.0)
    result = write(tmp_path, outcomes, samples, {"llama": {"vllm:prompt_tokens_cached_total{}": 21000.0}})
    assert result["problems"] == [
        "llama: the connector loaded nothing from the store in 1 start(s) of its server: the run did not test it"]


def killed_at_60_s(tmp_path: Path) -> tuple[list[Outcome], dict[str, list[dict[str, Any]]]]:
    """The steady run with its server killed at 60 s and started again: requests and samples after it are
    the second start's, whose counters started again."""
    outcomes, samples = steady_run(tmp_path)
    for outcome in outcomes[60:]:
        outcome.incarnation = 2
    for sample in samples["llama"]:
        if sample["time"] >= 60:
            sample.update(incarnation=2, connector=counts(loaded=0.0, external=0.0))
    return outcomes, samples


def test_what_a_killed_server_loaded_counts_when_its_last_start_loaded_nothing(tmp_path: Path) -> None:
    # Seen in CI: the llama server started again for the run's last 40 s, whose one store hit (256 tokens)
    # was not loaded; its first start had loaded thousands. The run tested the connector.
    outcomes, samples = killed_at_60_s(tmp_path)
    cached = sum(outcome.cached_tokens for outcome in outcomes[60:])
    result = write(tmp_path, outcomes, samples, {"llama": {
        "vllm:prompt_tokens_cached_total{}": float(cached), "vllm:external_prefix_cache_hits_total{}": 256.0,
        "vllm:kvgroups_short_loads_total{}": 1.0}})
    assert result["problems"] == []
    assert result["connector per start"]["llama"] == {
        "1": counts(loaded=448.0, external=560.0),  # its last sample, at 56 s
        "2": {**counts(loaded=0.0, external=256.0), "short loads": 1.0}}
    for sample in samples["llama"]:
        sample["connector"] = counts(loaded=0.0, external=0.0)
    result = write(tmp_path, outcomes, samples, {"llama": {
        "vllm:prompt_tokens_cached_total{}": float(cached), "vllm:external_prefix_cache_hits_total{}": 256.0}})
    assert result["problems"] == [
        "llama: the connector loaded nothing from the store in 2 start(s) of its server: the run did not test it"]


def test_an_earlier_start_that_loaded_more_than_vllm_was_promised_fails_the_run(tmp_path: Path) -> None:
    outcomes, samples = killed_at_60_s(tmp_path)
    # At 20 and 24 s: caught up by its last sample (56 s), still a broken invariant, reported at its first.
    samples["llama"][5]["connector"] = counts(loaded=300.0, external=200.0)
    samples["llama"][6]["connector"] = counts(loaded=330.0, external=240.0)
    cached = sum(outcome.cached_tokens for outcome in outcomes[60:])
    result = write(tmp_path, outcomes, samples, {"llama": {"vllm:prompt_tokens_cached_total{}": float(cached),
                                                           **LOADED}})
    assert result["problems"] == [
        "llama, start 1: /metrics says the connector loaded 300 tokens, more than the 200 vLLM served from its "
        "external cache"]


def test_metrics_that_disagree_with_the_clients_fail_the_run(tmp_path: Path) -> None:
    outcomes, samples = steady_run(tmp_path)
    result = write(tmp_path, outcomes, samples, {"llama": {
        "vllm:prompt_tokens_cached_total{}": 1.0, "vllm:kvgroups_loaded_tokens_total{}": 9.0,
        "vllm:external_prefix_cache_hits_total{}": 5.0}})
    assert result["problems"] == [
        "llama: its clients saw 21000 prompt tokens served from caches, /metrics counted 1",
        "llama, start 1: /metrics says the connector loaded 9 tokens, more than the 5 vLLM served from its "
        "external cache"]


def test_a_killed_servers_requests_are_counted_apart(tmp_path: Path) -> None:
    outcomes, samples = steady_run(tmp_path)
    outcomes.append(Outcome("llama", 29.95, 0.1, ok=False, error="Remote end closed", server_down=True))
    result = write(tmp_path, outcomes, samples)
    assert result["problems"] == [] and result["faults"][0]["killed server's"] == 1 and result["failed"] == 0


def test_repeated_faults_are_summed_per_kind_and_a_repetition_whose_hits_never_came_back_shows() -> None:
    def row(fault: str, requests: int, p99: float, back: float | None) -> dict[str, Any]:
        return {"fault": fault, "requests": requests, "errors": 0, "killed server's": 1, "differ": 0, "ties": 2,
                "p50 s": p99 / 4, "p99 s": p99, "hits back after s": back, "store hit tokens": 10}
    rows = [row("master killed", 10, 1.0, 2.0), row("node stopped", 5, 2.0, 1.0), row("master killed", 7, 3.0, 0.5),
            row("node stopped", 6, 1.0, None)]
    assert by_fault(rows) == [
        {"fault": "master killed", "times": 2, "requests": 17, "errors": 0, "killed server's": 2, "differ": 0,
         "ties": 4, "worst p50 s": 0.75, "worst p99 s": 3.0, "worst hits back after s": 2.0, "store hit tokens": 20},
        {"fault": "node stopped", "times": 2, "requests": 11, "errors": 0, "killed server's": 2, "differ": 0,
         "ties": 4, "worst p50 s": 0.5, "worst p99 s": 2.0, "worst hits back after s": None,
         "store hit tokens": 20}]


def test_an_interrupted_run_reports_what_ran_and_fails(tmp_path: Path) -> None:
    result = write(tmp_path, *steady_run(tmp_path), interrupted_at=61.5)
    assert result["problems"] == ["interrupted at 62 s of 80: the run is incomplete"]
    assert result["faults"][0]["requests"] == 10 and result["requests"] == 80
