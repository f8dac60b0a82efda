"""The soak's report (``benchmarks.soak.run``): what the clients saw, per fault and in all, against the
invariants the run must keep, printed as tables and written as JSON.

A request counts against a fault when it was in flight at any time while the fault held. The cache
share before the first fault (from ``STEADY_AFTER_SECONDS`` on) is the steady state; after a fault
ends, hits are back once ``RECOVERY_WINDOW`` requests in a row, starting among the first
``RECOVERY_REQUESTS``, had at least 0.8 of that share of their prompts served from caches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIE_LOGPROB = 1e-3  # a computed answer's two best tokens closer than this: a tie, not a difference
STEADY_AFTER_SECONDS = 10.0  # the steady state: from this long after the clients start to the first fault
RECOVERY_REQUESTS = 40  # hits must be back starting among this many requests after a fault ends
RECOVERY_WINDOW = 8  # requests in a row that must be served from caches as before the faults
LOADED = "vllm:kvgroups_loaded_tokens_total"  # the connector's, per server
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # vLLM's: what it was promised from the store
# What each start of a server counted on its /metrics, sampled as it runs (``connector`` in a sample):
# a restarted server's counters start again, and its last start may serve only the run's tail.
CONNECTOR_COUNTERS = {"loaded": LOADED, "external hits": EXTERNAL_HITS,
                      "short loads": "vllm:kvgroups_short_loads_total",
                      "failed reads": "vllm:kvgroups_failed_reads_total",
                      "corrupt entries": "vllm:kvgroups_corrupt_entries_total",
                      "tier errors": "vllm:kvgroups_errors_total"}
GROWTH_FLOOR = {"rss": 32 << 20, "threads": 4, "files": 16}  # growth within these is not a leak
FLAT_SAMPLES = 12  # the fewest samples of a server's run whose quarters' medians are compared
# The file store keeps each of its fan-out directories open once it has touched it: a cache that fills
# (over minutes in the quick run), counted apart from the files that must stay flat, and bounded. A scan
# of the store (its budget, its stats) lists one directory at a time through a descriptor of its own:
# the hour's run saw 257 in a process. A leak passes any bound in time; a scan or two more is none.
SHARD_DIRECTORIES = 256
SCANS_IN_FLIGHT = 2


@dataclass
class Outcome:
    """One request's result, as a client saw it."""

    server: str
    started: float
    seconds: float
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    differs: bool = False
    tie: bool = False
    server_down: bool = False  # the server was killed while it ran, or was down when it was sent
    incarnation: int = 0  # which start of its server answered
    reference_cached_tokens: int = 0  # the computed answer's: must be 0 (a fresh cache salt, the store off)


def kinds_grown(second: list[dict[str, Any]], fourth: list[dict[str, Any]]) -> str:
    """Which kinds of open files grew between two quarters' samples (medians), e.g. ``: socket +250``."""
    names = sorted({kind for sample in second + fourth for kind in sample.get("file_kinds", {})})
    grown = []
    for kind in names:
        added = (statistics.median(sample.get("file_kinds", {}).get(kind, 0) for sample in fourth)
                 - statistics.median(sample.get("file_kinds", {}).get(kind, 0) for sample in second))
        if added:
            grown.append(f"{kind} {added:+.0f}")
    return ": " + ", ".join(grown) if grown else ""


class SoakReport:
    """The outcomes and samples of one soak, and the faults it ran, held to the invariants."""

    def __init__(self, outcomes: list[Outcome], samples: dict[str, list[dict[str, Any]]],
                 faults_run: list[dict[str, Any]], start: float, arguments: argparse.Namespace,
                 sampler_errors: list[str], *, tier_budget_bytes: int, cluster_maxmemory: int,
                 interrupted_at: float | None = None) -> None:
        self.outcomes, self.samples, self.faults_run, self.start = outcomes, samples, faults_run, start
        self.arguments, self.timeout, self.sampler_errors = arguments, arguments.timeout, sampler_errors
        self.tier_budget_bytes, self.cluster_maxmemory = tier_budget_bytes, cluster_maxmemory
        self.cached_seen: dict[str, tuple[int, float]] = {}  # server: (clients' cached tokens, /metrics')
        self.connector_seen: dict[str, dict[int, dict[str, float]]] = {}  # server: start: CONNECTOR_COUNTERS
        self.interrupted_at = interrupted_at

    def write(self, metrics: dict[str, dict[str, float]]) -> int:
        """Print the tables, write the JSON, and return the exit status: 1 if an invariant broke."""
        problems: list[str] = []
        if self.interrupted_at is not None:
            problems.append(f"interrupted at {self.interrupted_at:.0f} s of {self.arguments.minutes * 60:.0f}: the "
                            f"run is incomplete")
        outcomes = sorted(self.outcomes, key=lambda outcome: outcome.started)
        relative = [(outcome.started - self.start, outcome) for outcome in outcomes]
        first_fault = self.faults_run[0]["start"] if self.faults_run else float("inf")
        steady = [outcome for at, outcome in relative if outcome.ok and STEADY_AFTER_SECONDS <= at < first_fault]
        steady_latency = [outcome.seconds for outcome in steady] or [0.0]
        steady_share = steady_share_of(outcomes, self.start, first_fault)
        rows = []
        for index, fault in enumerate(self.faults_run):
            until = self.faults_run[index + 1]["start"] if index + 1 < len(self.faults_run) else float("inf")
            # In flight at any time while the fault held (a request sent just before a kill died in it).
            during = [outcome for at, outcome in relative
                      if at < fault["end"] and at + outcome.seconds > fault["start"]]
            after = [(at, outcome) for at, outcome in relative if fault["end"] <= at < until and outcome.ok]
            errors = [outcome for outcome in during if not outcome.ok and not outcome.server_down]
            down = [outcome for outcome in during + [o for _, o in after] if not outcome.ok and outcome.server_down]
            differs = [outcome for outcome in during if outcome.differs]
            latency = [outcome.seconds for outcome in during if outcome.ok] or [0.0]
            back = hits_back_after(after, fault["end"], steady_share)
            stored = self._store_hits(fault["start"], min(until, fault["end"] + 60.0))
            if errors:
                problems.append(f"{fault['fault']}: {len(errors)} requests failed ({errors[0].error})")
            if differs:
                problems.append(f"{fault['fault']}: {len(differs)} answers differ from the computed ones")
            if back is None and len(after) >= RECOVERY_WINDOW:
                problems.append(f"{fault['fault']}: caches did not serve {0.8 * steady_share:.2f} of prompts within "
                                f"{RECOVERY_REQUESTS} requests after it ended")
            elif back is None and self.interrupted_at is None:
                problems.append(f"{fault['fault']}: hits' return not measured: {len(after)} requests answered "
                                f"between its end and the next fault, {RECOVERY_WINDOW} needed")
            row = {"fault": fault["fault"], "requests": len(during), "errors": len(errors),
                   "killed server's": len(down), "differ": len(differs),
                   "ties": sum(outcome.tie for outcome in during),
                   "p50 s": percentile(latency, 0.5), "p99 s": percentile(latency, 0.99),
                   "steady p50 s": percentile(steady_latency, 0.5), "steady p99 s": percentile(steady_latency, 0.99),
                   "hits back after s": back, "store hit tokens": stored}
            rows.append(row)
        every_error = [outcome for outcome in outcomes if not outcome.ok and not outcome.server_down]
        late = [outcome for outcome in outcomes if outcome.ok and outcome.seconds > self.timeout]
        if every_error and not any(problem.endswith(")") for problem in problems):
            problems.append(f"{len(every_error)} requests failed outside the faults ({every_error[0].error})")
        if late:
            problems.append(f"{len(late)} requests took longer than {self.timeout} s")
        differs_total = sum(outcome.differs for outcome in outcomes)
        if differs_total and not any("differ" in problem for problem in problems):
            problems.append(f"{differs_total} answers differ from the computed ones outside the faults")
        flat = self._flatness(problems)
        self._budgets(problems)
        referenced = [outcome for outcome in outcomes if outcome.reference_cached_tokens]
        if referenced:
            problems.append(f"{len(referenced)} computed answers (a fresh cache salt, the store off) were served "
                            f"{referenced[0].reference_cached_tokens} tokens from a cache")
        for name, found in metrics.items():
            # What the clients of the server's last start saw served from caches, against its counter.
            # (A start that answered nothing yet is still the last: its samples say it ran.)
            last = max([outcome.incarnation for outcome in outcomes if outcome.server == name]
                       + [sample["incarnation"] for sample in self.samples.get(name, [])], default=0)
            seen = sum(outcome.cached_tokens for outcome in outcomes
                       if outcome.server == name and outcome.ok and outcome.incarnation == last)
            counted = counter(found, "vllm:prompt_tokens_cached_total")
            self.cached_seen[name] = (seen, counted)
            if seen != counted:
                problems.append(f"{name}: its clients saw {seen} prompt tokens served from caches, /metrics counted "
                                f"{counted:.0f}")
            starts = self.connector_counts(name, found, last)
            if not sum(counts["loaded"] for counts in starts.values()):
                problems.append(f"{name}: the connector loaded nothing from the store in {len(starts)} start(s) of "
                                f"its server: the run did not test it")
            # Every reading, not only each start's last: a counter that ran ahead and was caught up shows too
            # (each start's first such reading is the one reported).
            readings = [(sample["incarnation"], sample["connector"]) for sample in self.samples.get(name, [])
                        if "connector" in sample] + [(last, starts[last])]
            ahead = {start: counts for start, counts in reversed(readings)
                     if counts["loaded"] > counts["external hits"]}
            for start, counts in sorted(ahead.items()):
                problems.append(f"{name}, start {start}: /metrics says the connector loaded "
                                f"{counts['loaded']:.0f} tokens, more than the {counts['external hits']:.0f} "
                                f"vLLM served from its external cache")
        kinds = by_fault(rows)
        self._print(rows, kinds, outcomes, flat, metrics, steady_share)
        slowest = sorted(relative, key=lambda item: -item[1].seconds)[:10]
        print("\nslowest requests: " + ", ".join(f"{outcome.server} at {at:.1f} s took {outcome.seconds:.1f} s"
                                                 for at, outcome in slowest))
        result = {"faults": rows, "by fault": kinds, "requests": len(outcomes), "failed": len(every_error),
                  "timeline": [{"at": round(at, 3), **{key: value for key, value in vars(outcome).items()
                                                        if key not in ("tokens", "started")}}
                               for at, outcome in relative],
                  "fault times": self.faults_run,
                  "killed server's": sum(outcome.server_down for outcome in outcomes), "differ": differs_total,
                  "ties": sum(outcome.tie for outcome in outcomes), "flat": flat, "problems": problems,
                  "steady cached share": steady_share, "minutes": self.arguments.minutes,
                  "cached tokens (clients, /metrics)": self.cached_seen,
                  "connector per start": {name: {str(start): counts for start, counts in starts.items()}
                                          for name, starts in self.connector_seen.items()},
                  "samples lost": self.sampler_errors}
        Path(self.arguments.json).write_text(json.dumps(result, indent=2))
        for problem in problems:
            print(f"BROKEN: {problem}", file=sys.stderr)
        return 1 if problems else 0

    def _store_hits(self, start: float, end: float) -> int:
        """Prompt tokens the servers loaded from the store between ``start`` and ``end`` (seconds from the
        start), from their /metrics counters as sampled (a restarted server's counters start again)."""
        total = 0.0
        for name, samples in self.samples.items():
            if name == "cluster":
                continue
            inside = [sample for sample in samples if "connector" in sample
                      and start <= sample["time"] - self.start <= end]
            for before, after in itertools.pairwise(inside):
                if before["incarnation"] == after["incarnation"]:
                    total += max(0.0, after["connector"]["external hits"] - before["connector"]["external hits"])
        return int(total)

    def connector_counts(self, name: str, final: dict[str, float], last: int) -> dict[int, dict[str, float]]:
        """Per start of server ``name``, its :data:`CONNECTOR_COUNTERS`: an earlier start's as last sampled
        (what a killed server counted after its last sample is lost), the last start's from ``final``, its
        /metrics at the end."""
        starts: dict[int, dict[str, float]] = {}
        for sample in self.samples.get(name, []):  # in time order: a start's later samples replace its earlier
            if "connector" in sample:
                starts[sample["incarnation"]] = dict(sample["connector"])
        starts[last] = {kind: counter(final, metric) for kind, metric in CONNECTOR_COUNTERS.items()}
        self.connector_seen[name] = dict(sorted(starts.items()))
        return self.connector_seen[name]

    def _flatness(self, problems: list[str]) -> dict[str, dict[str, float]]:
        """Per server (its longest run, when it ran long enough), the last quarter's median of each
        resource over the second quarter's. Growth past 5% breaks the run when it is also more than
        :data:`GROWTH_FLOOR` of that resource: the few connections a server opens to a master promoted
        mid-run are not a leak (seen: 15 more files in a three-minute run), and whatever grows with time
        passes both in an hour."""
        found: dict[str, dict[str, float]] = {}
        for name, samples in self.samples.items():
            if name == "cluster":
                continue
            runs: dict[int, list[dict[str, Any]]] = {}
            for sample in samples:
                runs.setdefault(sample["incarnation"], []).append(sample)
            last = max(runs.values(), key=len)  # a server killed and started again: its longest run
            if len(last) < FLAT_SAMPLES:
                problems.append(f"{name}: {len(last)} samples of its longest run, too few to tell its resources "
                                f"flat ({FLAT_SAMPLES} needed)")
                continue
            quarter = len(last) // 4
            second, fourth = last[quarter:2 * quarter], last[3 * quarter:]
            found[name] = {}
            for kind, floor in GROWTH_FLOOR.items():
                before = statistics.median(sample[kind] for sample in second)
                after = statistics.median(sample[kind] for sample in fourth)
                growth = found[name][kind] = after / max(1, before)
                found[name][f"{kind} added"] = after - before
                if growth > 1.05 and after - before > floor:
                    problems.append(f"{name}: {kind} grew {growth:.3f}x ({after - before:+.0f}) from the second "
                                    f"quarter to the last" + (kinds_grown(second, fourth) if kind == "files" else ""))
        return found

    def _most_shards(self, name: str) -> int:
        return max((sample.get("most_shard_directories", 0) for sample in self.samples.get(name, [])), default=0)

    def _budgets(self, problems: list[str]) -> None:
        for name, samples in self.samples.items():
            if name == "cluster":
                worst = max((sample["used"] for sample in samples), default=0)
                if worst > self.cluster_maxmemory * 1.1:
                    problems.append(f"a cluster master held {worst} bytes, over its maxmemory {self.cluster_maxmemory}")
                continue
            most = self._most_shards(name)
            if most > SHARD_DIRECTORIES + SCANS_IN_FLIGHT:
                problems.append(f"a process of {name} held {most} descriptors of its file tier's shard directories; "
                                f"the store keeps at most {SHARD_DIRECTORIES}, and a scan lists one more")
            worst = max((sample["tier_bytes"] for sample in samples), default=0)
            if worst > self.tier_budget_bytes * 1.05:
                problems.append(f"{name}'s file tier held {worst} bytes, over its budget of {self.tier_budget_bytes}")

    def _print(self, rows: list[dict[str, Any]], kinds: list[dict[str, Any]], outcomes: list[Outcome],
               flat: dict[str, dict[str, float]], metrics: dict[str, dict[str, float]], steady_share: float) -> None:
        print(f"\n{self.arguments.minutes:g} minutes, {2 * self.arguments.clients} clients on 2 servers; "
              f"{len(outcomes)} requests (each asked twice: served, and computed from nothing); before the first "
              f"fault {steady_share:.2f} of prompt tokens came from caches\n")
        print_table(rows)
        if len(kinds) < len(rows):
            print("\nper kind of fault:\n")
            print_table(kinds)
        for name, growth in flat.items():
            print(f"\n{name}: last quarter / second quarter: " + ", ".join(
                f"{kind} {growth[kind]:.3f}x ({growth[kind + ' added']:+.0f})" for kind in GROWTH_FLOOR)
                + f"; shard directories open at most {self._most_shards(name)} in a process")
        for name, starts in self.connector_seen.items():
            seen, counted = self.cached_seen.get(name, (0, 0.0))
            print(f"{name}: /metrics, per start of its server: " + "; ".join(
                f"start {start}: " + ", ".join(f"{kind} {value:.0f}" for kind, value in counts.items())
                for start, counts in starts.items())
                + f"; its last start's cached prompt tokens {counted:.0f}, its clients saw {seen}")
        if self.sampler_errors:
            print(f"{len(self.sampler_errors)} samples lost: {self.sampler_errors[0]}")


def print_table(rows: list[dict[str, Any]]) -> None:
    """``rows`` as a Markdown table, their keys the columns."""
    columns = list(rows[0]) if rows else []
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join("-" if value is None else f"{value:.2f}" if isinstance(value, float)
                                else str(value) for value in row.values()) + " |")


def by_fault(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-fault rows of a run, one per kind of fault: how often it ran, the requests, errors and
    answers that differ summed, the worst latencies and the slowest return of hits (None when any
    repetition has none: never back, or too few requests after it to tell), the tokens loaded from
    the store summed."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        kinds.setdefault(row["fault"], []).append(row)
    summary = []
    for name, each in kinds.items():
        backs = [row["hits back after s"] for row in each]
        summary.append({
            "fault": name, "times": len(each),
            **{column: sum(row[column] for row in each) for column in ("requests", "errors", "killed server's",
                                                                        "differ", "ties")},
            "worst p50 s": max(row["p50 s"] for row in each), "worst p99 s": max(row["p99 s"] for row in each),
            "worst hits back after s": None if None in backs else max(backs),
            "store hit tokens": sum(row["store hit tokens"] for row in each)})
    return summary


def steady_share_of(outcomes: list[Outcome], start: float, first_fault: float) -> float:
    """The share of prompt tokens served from caches before the faults (from ``STEADY_AFTER_SECONDS`` on;
    ``first_fault`` in seconds into the run)."""
    return cached_share([outcome for outcome in outcomes
                         if outcome.ok and STEADY_AFTER_SECONDS <= outcome.started - start < first_fault])


def hits_back_after(after: list[tuple[float, Outcome]], end: float, steady_share: float) -> float | None:
    """Seconds from ``end`` (a fault's) until hits were back, or None: the first ``RECOVERY_WINDOW`` requests in
    a row, starting among the first ``RECOVERY_REQUESTS`` of ``after`` (answered requests sent since ``end``,
    as (seconds into the run, outcome) in the order sent), whose prompts came from caches at least 0.8 times as
    much as before the faults."""
    return next((after[count + RECOVERY_WINDOW - 1][0] - end
                 for count in range(min(RECOVERY_REQUESTS, len(after) - RECOVERY_WINDOW + 1))
                 if cached_share([o for _, o in after[count:count + RECOVERY_WINDOW]]) >= 0.8 * steady_share),
                None)


def counter(found: dict[str, float], name: str) -> float:
    """A counter of a server's /metrics (``found``: its lines, labels and all), summed over its labels."""
    return sum(value for key, value in found.items() if key.startswith(name))


def cached_share(outcomes: list[Outcome]) -> float:
    """The share of these requests' prompt tokens that came from caches (vLLM's own and the store)."""
    prompt = sum(outcome.prompt_tokens for outcome in outcomes)
    return sum(outcome.cached_tokens for outcome in outcomes) / prompt if prompt else 0.0


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]
