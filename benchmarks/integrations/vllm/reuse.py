"""vLLM with KVGroupsConnector serving stored prefixes: time to first token, a mixed batch, the scheduler's time.

A random-weight llama-like model (``models.LLAMA_LIKE``: 8 layers, hidden 1024, 16 heads, 8 KV
heads, float32, 32 KiB of KV per token) on vLLM's CPU engine: block size 128, vLLM's prefix cache
off, 4096 batched tokens per step, chunks of 256 tokens in a file store. One engine with the
connector measures, interleaved round by round:

* ``ttft``: a 2048-token prompt whose first 1792 tokens (7 chunks, 56 MiB) are stored ("reused")
  against the same prompt with the connector turned off for the request ("computed":
  ``kv_transfer_params={"kvgroups": {"load": False, "save": False}}``); TTFT is the wall time of
  ``LLM.generate`` with ``max_tokens=1``. Per reused request: the time spent inside
  ``get_num_new_matched_tokens`` (all its calls), the entry bytes the worker read (the store's
  counters) and the bytes the process read (``rchar`` of ``/proc/self/io``).
* ``big``: the same for an 8448-token prompt whose first 8192 tokens (256 MiB) are stored.
* ``batch``: 12 prompts of 2048 tokens submitted together (8 output tokens each): all opted out,
  all fresh (misses, saved), and 6 sharing the stored 1792-token prefix + 6 fresh; wall time,
  output tokens/s, TTFT of each request.

An engine without any connector, in its own process (vLLM runs one engine per process once the
connector's numba kernels are loaded), measures the computed TTFT and the batch for reference.

Run with the vLLM environment: ``.venv-vllm/bin/python -m benchmarks.integrations.vllm.reuse [--rounds N]``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.support.unmeasured import Unmeasured
from tests.support.paths import ROOT

PROMPT, SHARED, BIG, CHUNK, BATCH, OUTPUT_TOKENS = 2048, 1792, 8192, 256, 12, 8
OFF = {"kvgroups": {"load": False, "save": False}}
KV_BYTES_PER_TOKEN = 8 * 2 * 512 * 4  # layers x (K, V) x 8 KV heads of 64 x float32
PAUSE_SECONDS = 0.25  # between two engines' turns: the one that ran lets go of the cores (OpenMP threads spin a while)
ENGINE = [sys.executable, "-m", "benchmarks.integrations.vllm.reuse", "--engine"]  # an engine process: this module


def tokens(seed: int, count: int) -> list[int]:
    return [(index * 7919 + seed * 104729 + 13) % 31000 + 500 for index in range(count)]


class Probe:
    """Time inside the connector's get_num_new_matched_tokens per request, and bytes read (in-process engine)."""

    def __init__(self) -> None:
        from kvgroups.integrations.vllm.connector import KVGroupsConnector

        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        original = KVGroupsConnector.get_num_new_matched_tokens
        probe = self

        def timed(self: Any, request: Any, num_computed_tokens: int) -> Any:
            begin = time.perf_counter()
            try:
                return original(self, request, num_computed_tokens)
            finally:
                probe.seconds[request.request_id] += time.perf_counter() - begin
                probe.calls[request.request_id] += 1

        KVGroupsConnector.get_num_new_matched_tokens = timed  # type: ignore[method-assign]

    def lookup(self, request_id: str) -> tuple[float, int]:
        """Seconds and calls of the request whose engine id starts with ``request_id``."""
        keys = [key for key in self.seconds if key.split("-")[0] == request_id]
        return sum(self.seconds[key] for key in keys), sum(self.calls[key] for key in keys)

    @staticmethod
    def entry_bytes_read() -> int:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        store = get_kv_transfer_group()._worker.store
        return int(sum(store.stats.bytes_read))

    @staticmethod
    def process_bytes_read() -> int:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["rchar"])


def engine_run(model: str, store: str | None, rounds: int, out: str, extra_config: dict[str, Any],
               kv_events: str | None = None) -> None:
    """In a fresh process: one engine (with the connector when ``store``), its measurements as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    probe = Probe() if store is not None else None
    extra: dict[str, Any] = {}
    if kv_events is not None:  # vLLM publishes its KV events (the connector's too) over ZMQ there
        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events,
                                                   topic="kv")
    if store is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"store": store, "chunk_size": CHUNK, **extra_config},
            kv_load_failure_policy="recompute")
    llm = LLM(model=model, dtype="float32", block_size=128, enforce_eager=True, enable_prefix_caching=False,
              max_model_len=BIG + 2 * CHUNK, max_num_batched_tokens=4096, max_num_seqs=16, seed=0,
              skip_tokenizer_init=True, **extra)
    engine = llm.llm_engine
    counter = iter(range(10**6))

    def run(prompts: list[list[int]], params_of: list[Any], max_tokens: int) -> dict[str, Any]:
        """Submit together, step to the end: wall seconds, TTFT and cached tokens per request, request ids."""
        ids = [f"r{next(counter):06d}" for _ in prompts]
        started = time.perf_counter()
        for request_id, prompt, transfer in zip(ids, prompts, params_of, strict=True):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                    extra_args={"kv_transfer_params": transfer} if transfer else None)
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        first: dict[str, float] = {}
        cached: dict[str, int] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.outputs[0].token_ids and output.request_id not in first:
                    first[output.request_id] = time.perf_counter() - started
                if output.finished:
                    cached[output.request_id] = output.num_cached_tokens or 0
        return {"seconds": time.perf_counter() - started, "ttft": [first[i] for i in ids],
                "cached": [cached[i] for i in ids], "ids": ids}

    def single(prompt: list[int], transfer: Any) -> dict[str, Any]:
        read_before = (probe.entry_bytes_read(), probe.process_bytes_read()) if probe else (0, 0)
        result = run([prompt], [transfer], 1)
        if probe is not None:
            result["lookup_seconds"], result["lookup_calls"] = probe.lookup(result["ids"][0])
            result["entry_bytes"] = probe.entry_bytes_read() - read_before[0]
            result["process_bytes"] = probe.process_bytes_read() - read_before[1]
        return result

    shared, big = tokens(1, SHARED), tokens(2, BIG)
    fresh = iter(range(100, 10**6))
    results: dict[str, Any] = collections.defaultdict(list)
    if store is not None:
        from kvgroups.integrations.vllm import flush_saves

        run([shared + tokens(next(fresh), PROMPT - SHARED), big + tokens(next(fresh), 2 * CHUNK - 64)],
            [None, None], 1)  # computes both prefixes and saves their chunks
        llm.collective_rpc(flush_saves)
    single(shared + tokens(next(fresh), PROMPT - SHARED), OFF if store else None)  # warm-up
    for _ in range(rounds):
        tail = tokens(next(fresh), PROMPT - SHARED)
        results["computed"].append(single(shared + tail, OFF if store else None))
        if store is None:
            results["batch plain"].append(run([tokens(next(fresh), PROMPT) for _ in range(BATCH)], [None] * BATCH,
                                              OUTPUT_TOKENS))
            continue
        results["reused"].append(single(shared + tokens(next(fresh), PROMPT - SHARED), None))
        results["big"].append(single(big + tokens(next(fresh), 2 * CHUNK - 64), None))
        results["batch opted out"].append(run([tokens(next(fresh), PROMPT) for _ in range(BATCH)], [OFF] * BATCH,
                                              OUTPUT_TOKENS))
        results["batch all miss"].append(run([tokens(next(fresh), PROMPT) for _ in range(BATCH)], [None] * BATCH,
                                             OUTPUT_TOKENS))
        mixed = [shared + tokens(next(fresh), PROMPT - SHARED) if index % 2 == 0 else tokens(next(fresh), PROMPT)
                 for index in range(BATCH)]
        batch = run(mixed, [None] * BATCH, OUTPUT_TOKENS)
        batch["lookup_seconds"] = [probe.lookup(request_id)[0] for request_id in batch["ids"]] if probe else []
        results["batch 6 hits"].append(batch)
        llm.collective_rpc(flush_saves)
    Path(out).write_text(json.dumps(results))


def hits_run(model: str, store: str, extra_config: dict[str, Any], commands_fd: int, results_fd: int) -> None:
    """In a fresh process: an engine with vLLM's prefix cache on and the connector, which runs a round each time
    the parent asks (a line on ``commands_fd``) and answers with its times (a JSON line on ``results_fd``).

    A round times the first token of a 2048-token prompt whose first 1792 tokens come from the store
    (vLLM's own cache emptied first, the store holding them), from vLLM's own prefix cache (the same
    prefix again), and computed (a fresh prompt, the connector off for it)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvgroups.integrations.vllm import flush_saves

    llm = LLM(model=model, dtype="float32", block_size=128, enforce_eager=True, enable_prefix_caching=True,
              max_model_len=PROMPT + CHUNK, max_num_batched_tokens=4096, max_num_seqs=16, seed=0,
              skip_tokenizer_init=True, kv_transfer_config=KVTransferConfig(
                  kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"store": store, "chunk_size": CHUNK, **extra_config},
                  kv_load_failure_policy="recompute"))
    fresh = iter(range(1000, 10**6))

    def ttft(prompt: list[int], transfer: Any = None) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": transfer} if transfer else None)
        begin = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - begin, int(output.num_cached_tokens or 0)

    ttft(tokens(next(fresh), PROMPT), OFF)  # warm-up
    with os.fdopen(commands_fd) as commands, os.fdopen(results_fd, "w") as results:
        results.write("ready\n")
        results.flush()
        for line in commands:
            round_ = int(line)
            shared = tokens(10 + round_, SHARED)
            ttft(shared + tokens(next(fresh), PROMPT - SHARED))  # computed and stored
            llm.collective_rpc(flush_saves)
            llm.reset_prefix_cache()  # vLLM's own cache forgets it: only the store holds the prefix now
            prompts = {"store hit": (shared + tokens(next(fresh), PROMPT - SHARED), None),
                       "vLLM prefix cache": (shared + tokens(next(fresh), PROMPT - SHARED), None),
                       "computed": (tokens(next(fresh), PROMPT), OFF)}
            # The store hit must come first (it fills vLLM's cache); the computed one is run before or after it.
            order = ["store hit", "vLLM prefix cache", "computed"] if round_ % 2 else \
                ["computed", "store hit", "vLLM prefix cache"]
            results.write(json.dumps({name: ttft(*prompts[name]) for name in order}) + "\n")
            results.flush()


class HitsEngine:
    """One ``--hits`` engine in a process of its own, running a round whenever :meth:`round` asks for one."""

    def __init__(self, model: str, store: str, directory: Path, name: str, extra_config: dict[str, Any]) -> None:
        self.name = name
        commands_read, self._commands = os.pipe()
        self._results, results_write = os.pipe()
        self.log = directory / f"{name}.log"
        command = [*ENGINE, "--hits", "--model", model, "--store", store,
                   "--extra-config", json.dumps(extra_config), "--commands-fd", str(commands_read),
                   "--results-fd", str(results_write)]
        with self.log.open("w") as log:  # a file, not a pipe: nobody reads vLLM's logs while it runs
            self.process = subprocess.Popen(command, cwd=ROOT, env=engine_environment(), stdout=log, stderr=log,
                                            pass_fds=(commands_read, results_write))
        os.close(commands_read)
        os.close(results_write)
        self._answers = os.fdopen(self._results)
        self._asks = os.fdopen(self._commands, "w")

    def _answer(self) -> str:
        line = self._answers.readline()
        if not line:  # the engine ended
            engine_failed(self.name, self.process.wait(), self.log.read_text(errors="replace"))
        return line

    def ready(self) -> None:
        self._answer()

    def round(self, round_: int) -> dict[str, list[float]]:
        with contextlib.suppress(BrokenPipeError):  # an engine that ended is reported by _answer, with why
            self._asks.write(f"{round_}\n")
            self._asks.flush()
        answer: dict[str, list[float]] = json.loads(self._answer())
        return answer

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a command it never read, if it ended
            self._asks.close()
        self.process.wait()
        self._answers.close()


def interleaved_hits(model: str, directory: Path, rounds: int) -> dict[str, dict[str, list[list[float]]]]:
    """Both load modes' engines started side by side, then driven round by round, the modes' order alternating
    (one computes while the other waits on its pipe), so that their rounds pair up."""
    modes = ("async", "sync")
    engines = {mode: HitsEngine(model, f"file://{directory}/kv-{mode}", directory, f"hits-{mode}",
                                {"load_mode": mode}) for mode in modes}
    by_mode: dict[str, dict[str, list[list[float]]]] = {mode: collections.defaultdict(list) for mode in modes}
    try:
        for engine in engines.values():
            engine.ready()
        for round_ in range(rounds):
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                time.sleep(PAUSE_SECONDS)
                for name, value in engines[mode].round(round_).items():
                    by_mode[mode][name].append(value)
    finally:
        for engine in engines.values():
            engine.close()
    return by_mode


def report_hits(by_mode: dict[str, dict[str, list[list[float]]]], rounds: int) -> None:
    print(f"vLLM CPU engine, llama-like model, block 128, vLLM's prefix cache on; a 2048-token prompt, 1792 tokens "
          f"cached; medians of {rounds} rounds; an engine per load mode, the two running side by side, a round "
          f"of each in turn\n")
    print("| load mode | served from | TTFT s | cached tokens | vs vLLM's prefix cache (paired) | "
          "vs computed (paired) | vs the synchronous load's (paired) |")
    print("|---|---|---|---|---|---|---|")
    for mode, results in by_mode.items():
        local = [seconds for seconds, _ in results["vLLM prefix cache"]]
        computed = [seconds for seconds, _ in results["computed"]]
        for name in ("store hit", "vLLM prefix cache", "computed"):
            runs = results[name]
            seconds = [value for value, _ in runs]
            synchronous = [value for value, _ in by_mode["sync"][name]]
            vs_local = median([value / base for value, base in zip(seconds, local, strict=True)])
            vs_computed = median([value / base for value, base in zip(seconds, computed, strict=True)])
            vs_sync = median([value / base for value, base in zip(seconds, synchronous, strict=True)])
            print(f"| {mode} | {name} | {median(seconds):.3f} | {median([cached for _, cached in runs]):.0f} | "
                  f"{vs_local:.2f}x | {vs_computed:.2f}x | {vs_sync:.2f}x |")


def engine_environment() -> dict[str, str]:
    """An engine's environment: in-process (vLLM's own processes would hold on to the caches), 4 GiB of KV."""
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def spawn(model: str, store: str | None, rounds: int, directory: Path, name: str,
          extra_config: dict[str, Any], kv_events: bool = False) -> dict[str, Any]:
    out = directory / f"{name}.json"
    command = [*ENGINE, "--model", model, "--rounds", str(rounds), "--out", str(out),
               "--extra-config", json.dumps(extra_config)]
    if kv_events:
        command += ["--kv-events", f"ipc://{directory}/{name}-kv-events"]
    if store is not None:
        command += ["--store", store]
    completed = subprocess.run(command, cwd=ROOT, env=engine_environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, check=False)
    if completed.returncode:
        engine_failed(name, completed.returncode, completed.stderr)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def engine_failed(name: str, returncode: int, output: str) -> None:
    """Nothing of this benchmark can be measured without its engines: the end of what the engine printed (on
    stderr), a row saying why, and exit 1."""
    print(f"the {name} engine failed:\n{output[-6000:]}", file=sys.stderr)
    lines = [line for line in output.splitlines() if line.strip()] or ["no output"]
    unmeasured = Unmeasured()
    print("| engine | result |\n|---|---|\n" + unmeasured.row(name, f"exited {returncode}: {lines[-1]}"))
    unmeasured.exit()


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(connector: dict[str, Any], plain: dict[str, Any], rounds: int) -> None:
    print(f"vLLM CPU engine, llama-like model, block 128, prefix cache off, 4096 batched tokens; medians of {rounds} "
          f"interleaved rounds\n")
    computed = [run["seconds"] for run in connector["computed"]]
    print("| request | TTFT s | vs computed (paired) | time in get_num_new_matched_tokens ms (calls) | "
          "entry bytes read / stored prefix | process bytes read / stored prefix |")
    print("|---|---|---|---|---|---|")
    print(f"| {PROMPT} tokens, computed (request opts out) | {median(computed):.3f} | 1.00x | - | - | - |")
    print(f"| {PROMPT} tokens, no connector (own process) | {median([r['seconds'] for r in plain['computed']]):.3f} | "
          f"{median(computed) / median([r['seconds'] for r in plain['computed']]):.2f}x (not paired) | - | - | - |")
    for name, stored in (("reused", SHARED), ("big", BIG)):
        runs = connector[name]
        prompt = PROMPT if name == "reused" else BIG + 2 * CHUNK - 64
        ratio = median([c / r["seconds"] for c, r in zip(computed, runs, strict=True)]) if name == "reused" else None
        print(f"| {prompt} tokens, {runs[0]['cached'][0]} reused ({stored * KV_BYTES_PER_TOKEN >> 20} MiB) | "
              f"{median([r['seconds'] for r in runs]):.3f} | {f'{ratio:.2f}x' if ratio else '-'} | "
              f"{median([r['lookup_seconds'] for r in runs]) * 1e3:.2f} "
              f"({median([r['lookup_calls'] for r in runs]):.0f})"
              f" | {median([r['entry_bytes'] for r in runs]) / (stored * KV_BYTES_PER_TOKEN):.3f} | "
              f"{median([r['process_bytes'] for r in runs]) / (stored * KV_BYTES_PER_TOKEN):.3f} |")
    print(f"\n{BATCH} prompts of {PROMPT} tokens submitted together, {OUTPUT_TOKENS} output tokens each\n")
    print("| batch | wall s | output tokens/s | vs opted out (paired) | vs no connector (not paired) | "
          "TTFT median s (the 6 sharing / all) | cached tokens |")
    print("|---|---|---|---|---|---|---|")
    base = [run["seconds"] for run in connector["batch opted out"]]
    plain_wall = median([run["seconds"] for run in plain["batch plain"]])
    rows = [("no connector (own process)", plain["batch plain"]), ("connector, every request opted out",
            connector["batch opted out"]), ("connector, all miss", connector["batch all miss"]),
            ("connector, 6 hits + 6 misses", connector["batch 6 hits"])]
    for name, runs in rows:
        wall = median([run["seconds"] for run in runs])
        paired = "-" if runs is plain["batch plain"] else \
            f"{median([b / run['seconds'] for b, run in zip(base, runs, strict=True)]):.2f}x"
        sharing = median([median(run["ttft"][0::2]) for run in runs])
        print(f"| {name} | {wall:.1f} | {BATCH * OUTPUT_TOKENS / wall:.2f} | {paired} | {plain_wall / wall:.2f}x | "
              f"{sharing:.2f} / {median([median(run['ttft']) for run in runs]):.2f} | {sum(runs[0]['cached'])} |")
    hits = connector["batch 6 hits"]
    lookups = [seconds * 1e3 for run in hits for seconds in run["lookup_seconds"][0::2]]
    print(f"\nInside the batch, time in get_num_new_matched_tokens per hit request: median {median(lookups):.2f} ms, "
          f"max {max(lookups):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-mode", choices=["async", "sync"], default="async")
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--extra-config", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--commands-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--results-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kv-events", nargs="?", const="on", default=None,
                        help="the connector's engine publishes vLLM's KV events (over ZMQ, to a socket nobody reads)")
    parser.add_argument("--hits", action="store_true",
                        help="only a store hit (loaded asynchronously and synchronously, an engine each, side by "
                             "side) against vLLM's own prefix cache serving the same tokens")
    args = parser.parse_args()
    if args.engine:
        if args.hits:
            hits_run(args.model, args.store, json.loads(args.extra_config), args.commands_fd, args.results_fd)
        else:
            engine_run(args.model, args.store, args.rounds, args.out, json.loads(args.extra_config), args.kv_events)
        return
    from benchmarks.support.models import save_llama_like

    with tempfile.TemporaryDirectory(prefix="kvgroups-vllm-bench-") as temporary:
        directory = Path(temporary)
        model = directory / "llama"
        save_llama_like(model)
        # Room for the 8448-token prompt of the 256 MiB prefix (rotary positions have no table limit).
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
        if args.hits:
            report_hits(interleaved_hits(str(model), directory, args.rounds), args.rounds)
            return
        connector = spawn(str(model), f"file://{directory}/kv", args.rounds, directory, "connector",
                          {"load_mode": args.load_mode}, kv_events=args.kv_events is not None)
        plain = spawn(str(model), None, args.rounds, directory, "plain", {})
    report(connector, plain, args.rounds)


if __name__ == "__main__":
    main()
