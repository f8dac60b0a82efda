"""Serving through faults: two ``vllm serve`` processes on one shared Valkey/Redis Cluster, faults injected.

Two servers of vLLM's CPU build (each ``python -m vllm.entrypoints.openai.api_server`` in its own
process group, vLLM's defaults: its prefix cache on, here in a KV space small enough that
conversations leave it and come back from the store), each with KVGroupsConnector on a file tier of
its own (on a small tmpfs, so that it can be filled) in front of one 3-master, 3-replica cluster:
``llama`` serves a tiny llama-like model, ``hybrid`` a tiny Gemma-3-like one (sliding and full
attention layers). Clients hold multi-round conversations with shared system prompts on both, for
``--minutes``; every prompt is also asked under a cache salt of its own with the store off, which
computes it from nothing: its greedy answer is the one every answer must equal. Faults come at known
times, each undone later (``soak_faults.Faults``): a master killed and started again, a node
stopped past the store's timeout, the cluster full (eviction off), a file tier's filesystem full,
entries corrupted and deleted behind the store's back, a store directory unwritable, a server
killed and started again.

Checked while it runs, and reported per fault and as JSON: every request answered within
``--timeout`` seconds (the killed server's in flight and while it is down are counted apart);
every answer equal to its computed one (a token where the computed answer's two best tokens are
within ``TIE_LOGPROB`` of each other is a tie of floating point, counted apart, never a pass for a
real difference); the share of prompt tokens served from caches back to its level before the
fault (``RECOVERY_WINDOW`` requests in a row, within ``RECOVERY_REQUESTS`` after it ends); each
server's resident memory, threads and open files flat (the last quarter's median within 5% of the
second quarter's, over the longest run of a server killed and started again; the file store's
shard directories, which it keeps open as it first touches each, counted apart: at most 256 a
process, and a scan's one more); the stores within their budgets; the connector's loaded tokens on
``/metrics`` no more than the tokens vLLM reports served from its external cache, in every start of
a server (sampled as it runs: a restarted server's counters start again), and more than none over
the run. A broken invariant fails the run (exit 1).

Run as root in the vLLM environment: ``.venv-vllm/bin/python -m benchmarks.soak.run`` (``make soak``, 60
minutes, every fault three times); ``--quick`` runs every fault once, each as soon as the last one's hits are back,
in about 3 minutes (what ``make test`` runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

from benchmarks.soak.faults import Fault, Faults, directory_bytes, mount_tmpfs, resources, unmount
from benchmarks.soak.report import (
    CONNECTOR_COUNTERS,
    RECOVERY_REQUESTS,
    RECOVERY_WINDOW,
    TIE_LOGPROB,
    Outcome,
    SoakReport,
    counter,
    hits_back_after,
    steady_share_of,
)
from benchmarks.support.vllm_serve import VllmServer
from tests.support.servers import running_cluster

CHUNK = 64
TAIL_SECONDS = 40.0  # the run goes on at least this long after the last fault's hits are back (--quick: 15)
TIER_MIB, TIER_BUDGET_MIB = 96, 64  # each file tier's tmpfs, and the store's budget in it
CLUSTER_MAXMEMORY = 256 << 20
MODELS = {"llama": "llama", "hybrid": "gemma3"}
# Each server's KV space: a little more than one 2048-token sequence, so that conversations leave vLLM's own
# prefix cache and come back from the store (llama-like: 1 KiB of K/V a token; Gemma-3-like: 2 KiB).
KV_MIB = {"llama": 3, "hybrid": 5}


class Server(VllmServer):
    """One of the soak's two servers: its model on a file tier in front of the cluster, answers with logprobs."""

    def command(self, port: int) -> list[str]:
        connector = {"kv_connector": "KVGroupsConnector", "kv_connector_module_path": "kvgroups.integrations.vllm",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"store": self.store, "chunk_size": CHUNK}}
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--block-size", "32", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--enable-prompt-tokens-details",
                "--kv-cache-memory-bytes", str(self.kv_bytes), "--kv-transfer-config", json.dumps(connector)]

    def complete(self, tokens: list[int], timeout: float, **extra: Any) -> dict[str, Any]:
        body = json.dumps({"model": self.name, "prompt": tokens, "max_tokens": 8, "temperature": 0, "logprobs": 2,
                           "return_token_ids": True, "ignore_eos": True, **extra}).encode()
        request = urllib.request.Request(f"{self.base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return dict(json.loads(answer.read()))

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(("vllm:kvgroups_", "vllm:external_prefix_cache_", "vllm:prompt_tokens_cached")):
                name, number = line.rsplit(" ", 1)
                found[name] = found.get(name, 0.0) + float(number)
        return found


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(count)]


def cached_of(response: dict[str, Any]) -> int:
    """The prompt tokens vLLM served from caches (its own and the connector's) for this request."""
    return int((response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def answer_of(response: dict[str, Any]) -> tuple[list[int], list[dict[str, float]]]:
    """The answer's token ids and each position's two best logprobs."""
    choice = response["choices"][0]
    logprobs = choice.get("logprobs") or {}
    return [int(token) for token in choice["token_ids"]], list(logprobs.get("top_logprobs") or [])


class Client(threading.Thread):
    """One user's conversations on one server: each round appends a question, asks it (the store serving
    what it holds) and asks it again under a fresh cache salt with the store off (computed from nothing),
    then appends the answer."""

    def __init__(self, soak: Soak, server: Server, user: int) -> None:
        super().__init__(name=f"client-{server.name}-{user}", daemon=True)
        self.soak, self.server, self.user = soak, server, user

    def run(self) -> None:
        server_seed = zlib.crc32(self.server.name.encode()) % 1000  # str hashes differ between processes
        rng = random.Random(self.user * 7919 + server_seed)
        system = tokens(server_seed, 256)  # every user of this server shares it
        conversation = 0
        while not self.soak.stopping.is_set():
            history = system + tokens(rng.randrange(10**9), 96)
            conversation += 1
            for _ in range(self.soak.rounds):
                if self.soak.stopping.is_set():
                    return
                history = history + tokens(rng.randrange(10**9), 48)
                if len(history) > 1800:
                    break
                answer = self.ask(history)
                if answer is None:
                    break
                history = history + answer

    def ask(self, prompt: list[int]) -> list[int] | None:
        server, soak = self.server, self.soak
        if not server.up.wait(timeout=900):
            return None
        incarnation = server.incarnation
        started = time.monotonic()
        try:
            reused = server.complete(prompt, soak.timeout)
            computed = server.complete(prompt, soak.timeout, cache_salt=f"reference-{random.getrandbits(64)}",
                                       kv_transfer_params={"kvgroups": {"load": False, "save": False}})
        except (OSError, urllib.error.URLError, json.JSONDecodeError, KeyError) as error:
            down = not server.up.is_set() or server.incarnation != incarnation
            soak.record(Outcome(server.name, started, time.monotonic() - started, ok=False, error=str(error)[:200],
                                server_down=down))
            return None
        got, _ = answer_of(reused)
        want, top = answer_of(computed)
        outcome = Outcome(server.name, started, time.monotonic() - started, ok=True,
                          prompt_tokens=int(reused["usage"]["prompt_tokens"]), cached_tokens=cached_of(reused),
                          tokens=got, incarnation=incarnation, reference_cached_tokens=cached_of(computed))
        if got != want:
            first = next(index for index, (a, b) in enumerate(zip([*got, None], [*want, None], strict=False))
                         if a != b)
            best = sorted(top[first].values(), reverse=True) if first < len(top) and top[first] else []
            outcome.tie = len(best) >= 2 and best[0] - best[1] < TIE_LOGPROB
            outcome.differs = not outcome.tie
        soak.record(outcome)
        return want


class Soak:
    def __init__(self, arguments: argparse.Namespace, directory: Path) -> None:
        self.arguments = arguments
        self.directory = directory
        self.rounds = arguments.rounds
        self.timeout = arguments.timeout
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.samples: dict[str, list[dict[str, Any]]] = {}
        self.faults_run: list[dict[str, Any]] = []
        self.sampler_errors: list[str] = []
        self.start = time.monotonic()
        self.interrupted_at: float | None = None  # seconds into the run a Ctrl-C stopped it

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    # --- sampling ----------------------------------------------------------------------------------
    def sampler(self, servers: dict[str, Server], cluster: Any, tiers: dict[str, Path]) -> None:
        # Often enough that a quick run's server killed mid-run has FLAT_SAMPLES of its first start.
        while not self.stopping.wait(2.0 if self.arguments.quick else 5.0):
            try:
                self._sample(servers, cluster, tiers)
            except Exception as error:  # a sample lost is reported, never the end of sampling
                self.sampler_errors.append(f"{type(error).__name__}: {error}"[:200])

    def _sample(self, servers: dict[str, Server], cluster: Any, tiers: dict[str, Path]) -> None:
        for name, server in servers.items():
            if server.up.is_set() and server.process is not None:
                sample = resources(server.process.pid, tiers[name] / "kv")
                sample.update(incarnation=server.incarnation, tier_bytes=directory_bytes(tiers[name] / "kv"))
                with contextlib.suppress(OSError, ValueError):
                    found = server.metrics()
                    sample["connector"] = {kind: counter(found, metric) for kind, metric in CONNECTOR_COUNTERS.items()}
                self.samples.setdefault(name, []).append(sample)
        used = []
        # A stopped node does not answer (nor, while the topology is moving, may another): skip it this time.
        with contextlib.suppress(subprocess.TimeoutExpired, StopIteration, RuntimeError, ValueError):
            for port in list(cluster.masters()):
                info = cluster.ask(port, "info", "memory")
                used += [int(line.split(":")[1]) for line in info.splitlines() if line.startswith("used_memory:")]
        if used:
            self.samples.setdefault("cluster", []).append({"time": time.monotonic(), "used": max(used)})

    # --- the run -----------------------------------------------------------------------------------
    def timing(self) -> tuple[float, float, float, float]:
        """Seconds of warm-up before the first fault, each fault's length, the least gap after each, and the tail
        after the last. Quick: each fault as long as a fault needs to hold (a master stopped past the store's 2 s
        timeout, a failover), the next one as soon as the last one's hits are back (``_await_hits_back``)."""
        return (15.0, 4.0, 4.0, 15.0) if self.arguments.quick else (180.0, 45.0, 75.0, TAIL_SECONDS)

    def schedule(self, faults: list[Fault]) -> list[tuple[float, float, Fault]]:
        """(start, end, fault) in seconds from the start: every fault once per cycle, after a warm-up."""
        quick = self.arguments.quick
        warm, length, gap, _ = self.timing()
        total = self.arguments.minutes * 60
        plan: list[tuple[float, float, Fault]] = []
        at = warm
        while True:
            for fault in faults:
                if at + length + gap > total and plan and not quick:
                    return plan
                plan.append((at, at + length, fault))
                at += length + gap
            if quick:
                return plan

    def run(self) -> int:
        arguments = self.arguments
        tiers = {name: self.directory / f"{name}-tier" for name in MODELS}
        for mount in tiers.values():
            mount_tmpfs(mount, TIER_MIB)
        try:
            with running_cluster(self.directory / "cluster", settings=(
                    "--maxmemory", str(CLUSTER_MAXMEMORY), "--maxmemory-policy", "allkeys-lru")) as cluster:
                return self._serve(arguments, cluster, tiers)
        finally:
            for mount in tiers.values():
                unmount(mount)

    def _serve(self, arguments: argparse.Namespace, cluster: Any, tiers: dict[str, Path]) -> int:
        from tests.integrations.vllm.tiny_vllm_models import save_model

        servers = {}
        cpus = sorted(os.sched_getaffinity(0))
        halves = [cpus[: max(1, len(cpus) // 2)], cpus[len(cpus) // 2:] or cpus]
        for (name, kind), own in zip(MODELS.items(), halves, strict=True):
            model = save_model(kind, self.directory / "models" / name, initializer_range=0.5)
            store = [f"file://{tiers[name]}/kv?max_bytes={TIER_BUDGET_MIB}MiB", cluster.url]
            servers[name] = Server(name, model, store, self.directory, kv_bytes=KV_MIB[name] << 20, cpus=own)
        try:
            return self._load(arguments, cluster, tiers, servers)
        finally:
            for server in servers.values():
                server.stop()

    def _load(self, arguments: argparse.Namespace, cluster: Any, tiers: dict[str, Path],
              servers: dict[str, Server]) -> int:
        starting = [threading.Thread(target=server.start, daemon=True) for server in servers.values()]
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join()
        if not all(server.up.is_set() for server in servers.values()):
            raise RuntimeError("a vllm serve did not start: see its log")
        faults = Faults(cluster, tiers, restart=lambda name: servers[name].start(),
                        kill=lambda name: servers[name].kill())
        plan = self.schedule(faults.all())
        self.start = time.monotonic()
        clients = [Client(self, server, user) for server in servers.values() for user in range(arguments.clients)]
        sampler = threading.Thread(target=self.sampler, args=(servers, cluster, tiers), daemon=True)
        for thread in (*clients, sampler):
            thread.start()
        try:
            undone, (_, _, gap, tail) = 0.0, self.timing()
            for planned_start, planned_end, fault in plan:
                late = 0.0
                if self.faults_run:
                    # A fault whose undoing ran long (a master restarted under CI's load), or whose hits come back
                    # late, pushes the rest of the plan back: hits' return is measured before the next fault.
                    late = max(0.0, undone + gap - planned_start, self._await_hits_back(undone) - planned_start)
                start, end = planned_start + late, planned_end + late
                self._sleep_until(start)
                injected = time.monotonic() - self.start
                print(f"[{injected:7.1f} s] {fault.name}: {fault.what}", flush=True)
                try:
                    fault.inject()
                    self._sleep_until(end)
                    fault.undo()
                finally:  # an interrupted fault (Ctrl-C) is reported up to then, undone by the cleanup below
                    undone = time.monotonic() - self.start
                    self.faults_run.append({"fault": fault.name, "what": fault.what, "start": injected,
                                            "end": undone})
                print(f"[{undone:7.1f} s] {fault.name}: undone", flush=True)
            # The last fault's recovery is measured too, however long its undoing took (a server's start-up).
            self._sleep_until(max(arguments.minutes * 60, self._await_hits_back(undone) + tail))
        except KeyboardInterrupt:
            # An hour's run stopped early still says what it saw, and fails: it is not the run asked for.
            self.interrupted_at = time.monotonic() - self.start
            print(f"[{self.interrupted_at:7.1f} s] interrupted: reporting what ran", file=sys.stderr, flush=True)
        finally:
            faults.cleanup()
            self.stopping.set()
            for thread in clients:
                thread.join(timeout=arguments.timeout + 30)
        metrics = {name: server.metrics() for name, server in servers.items() if server.up.is_set()}
        return self.report(metrics)

    def _await_hits_back(self, at: float) -> float:
        """Wait until the clients' hits are back after ``at`` (seconds into the run, a fault's end), as the report
        tells it (``hits_back_after``), or until so many requests were answered since that the report can tell
        they are not, at most ``--timeout`` seconds; return when that was, in seconds into the run."""
        deadline = time.monotonic() + self.timeout
        first_fault = self.faults_run[0]["start"] if self.faults_run else float("inf")
        while not self.stopping.is_set() and time.monotonic() < deadline:
            with self.lock:
                outcomes = sorted(self.outcomes, key=lambda outcome: outcome.started)
            after = [(outcome.started - self.start, outcome) for outcome in outcomes
                     if outcome.ok and outcome.started - self.start >= at]
            steady_share = steady_share_of(outcomes, self.start, first_fault)
            if (hits_back_after(after, at, steady_share) is not None
                    or len(after) >= RECOVERY_REQUESTS + RECOVERY_WINDOW):
                break
            time.sleep(0.2)
        return time.monotonic() - self.start

    def _sleep_until(self, at: float) -> None:
        while time.monotonic() - self.start < at and not self.stopping.is_set():
            time.sleep(min(1.0, at - (time.monotonic() - self.start)))

    def report(self, metrics: dict[str, dict[str, float]]) -> int:
        return SoakReport(self.outcomes, self.samples, self.faults_run, self.start, self.arguments,
                          self.sampler_errors, tier_budget_bytes=TIER_BUDGET_MIB << 20,
                          cluster_maxmemory=CLUSTER_MAXMEMORY, interrupted_at=self.interrupted_at).write(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--clients", type=int, default=3, help="per server")
    parser.add_argument("--rounds", type=int, default=6, help="questions per conversation")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a request may take")
    parser.add_argument("--quick", action="store_true", help="every fault once, about 3 minutes with start-ups")
    parser.add_argument("--json", default="soak.json")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.minutes = min(arguments.minutes, 2.0)
        arguments.clients = min(arguments.clients, 2)
    if os.geteuid() != 0:
        raise SystemExit("the soak mounts tmpfs file tiers: run it as root")
    with tempfile.TemporaryDirectory(prefix="kvgroups-soak-") as directory:
        sys.exit(Soak(arguments, Path(directory)).run())


if __name__ == "__main__":
    main()
