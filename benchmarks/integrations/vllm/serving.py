"""Many users in multi-round conversations on vLLM's CPU engine, with and without KVGroupsConnector.

In the style of LMCache's multi-round QA benchmark: ``--users`` users share a system prompt, each
has a context of its own, and each round every user asks a question (appended to their history)
and gets an answer (appended too); a user's next question waits for their answer, the users run
concurrently. Nothing of a user's history stays in vLLM between their rounds: vLLM's prefix cache
is off, as in ``reuse`` (the limit of a KV space too small to keep histories; with
``--prefix-caching`` it is on, in ``--kv-mib`` of KV space, and evicts histories as it fills), so
only the store has them. The model is ``models.LLAMA_LIKE`` (8 layers, hidden 1024, 8 KV heads,
32 KiB of KV per token), block size 128, 4096 batched tokens per step, chunks of 256 tokens in a
file store; or with ``--model qwen3-next-like`` the hybrid ``models.QWEN3_NEXT_LIKE`` (6 gated
DeltaNet and 2 full-attention layers, bfloat16, SSM states in float32) under vLLM's defaults:
its prefix cache on (so recurrent states on vLLM's block grid), the block size vLLM picks and
the connector's chunk following it.

Sessions (each with prompts of its own): no connector (its own process); the connector serving
hits; the connector with every request's loads turned off (all misses, saves on); vLLM's
``OffloadingConnector`` (a CPU tier) where it runs on vLLM's CPU platform, which it does not (the
error is printed). Reported: wall time, prompt and output tokens/s, TTFT p50/p90, the tokens
served by vLLM's cache and by the store, and the time the scheduler spends in the connector per
engine step (every scheduler-side connector call).

Run with the vLLM environment: ``.venv-vllm/bin/python -m benchmarks.integrations.vllm.serving``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OFF_LOADS = {"kvgroups": {"load": False}}
# How its engine processes run this module (spawn).
MODULE = "benchmarks.integrations.vllm.serving"
# What vLLM's OffloadingConnector raises on vLLM's CPU platform (vllm/v1/kv_offload/cpu/spec.py).
OFFLOADING_REFUSES_CPU = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
# Per model: how it is saved, the engine's settings, the connector's chunk (None: it follows vLLM's blocks),
# and whether vLLM's prefix cache is on unless --prefix-caching says so.
MODELS: dict[str, dict[str, Any]] = {
    "llama-like": {"save": "save_llama_like", "engine": {"dtype": "float32", "block_size": 128}, "chunk": 256,
                   "prefix_caching": False, "kv_bytes_per_token": 32 << 10},
    "qwen3-next-like": {"save": "save_qwen3_next_like",
                        "engine": {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}, "chunk": None,
                        "prefix_caching": True, "kv_bytes_per_token": 2 * 2 * 4 * 128 * 2},
}
SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished", "request_finished_all_groups", "update_connector_output")


def tokens(seed: int, count: int) -> list[int]:
    return [(index * 7919 + seed * 104729 + 13) % 31000 + 500 for index in range(count)]


class SchedulerClock:
    """Seconds the scheduler spends in the connector's scheduler-side calls, per engine step."""

    def __init__(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        from kvgroups.integrations.vllm.connector import KVGroupsConnector

        self.current = 0.0
        self.per_step: list[float] = []
        clock = self
        for name in SCHEDULER_CALLS:
            original = getattr(KVGroupsConnector, name)

            def timed(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
                begin = time.perf_counter()
                try:
                    return __original(self, *args, **kwargs)
                finally:
                    clock.current += time.perf_counter() - begin

            setattr(KVGroupsConnector, name, timed)
        schedule = Scheduler.schedule

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return schedule(self, *args, **kwargs)
            finally:
                clock.per_step.append(clock.current)
                clock.current = 0.0

        Scheduler.schedule = counted  # type: ignore[method-assign]


def engine_run(job: dict[str, Any]) -> None:
    """In a fresh process: one engine, its sessions, as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {}
    clock = None
    if job["connector"] == "kvgroups":
        clock = SchedulerClock()
        chunk = {"chunk_size": job["chunk"]} if job["chunk"] else {}
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"store": job["store"], **chunk},
            kv_load_failure_policy="recompute")
    elif job["connector"] == "offloading":
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 4 << 30})
    try:
        llm = LLM(model=job["model"], enforce_eager=True, **job["engine"],
                  enable_prefix_caching=job["prefix_caching"], kv_cache_memory_bytes=job["kv_mib"] << 20,
                  max_model_len=4096,
                  max_num_batched_tokens=4096, max_num_seqs=16, seed=0, skip_tokenizer_init=True, **extra)
    except Exception as error:  # an engine that does not start: its sessions are rows saying why
        Path(job["out"]).write_text(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return
    engine = llm.llm_engine
    sessions = []
    for session in job["sessions"]:
        steps_before = len(clock.per_step) if clock else 0
        sessions.append(conversation(engine, SamplingParams, job, session))
        if clock is not None:
            sessions[-1]["connector_seconds_per_step"] = clock.per_step[steps_before:]
    Path(job["out"]).write_text(json.dumps({"sessions": sessions}))


def conversation(engine: Any, sampling: Any, job: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """Every user's rounds; users run concurrently, each one's next question waits for its answer."""
    seed = session["seed"]
    system = tokens(1, job["system_tokens"])  # shared by every user and every session
    histories = [system + tokens(seed * 1000 + user, job["context_tokens"]) for user in range(job["users"])]
    rounds_left = [job["rounds"]] * job["users"]
    transfer = session.get("kv_transfer_params")
    params = sampling(temperature=0.0, max_tokens=job["answer_tokens"], ignore_eos=True,
                      extra_args={"kv_transfer_params": transfer} if transfer else None)
    submitted: dict[str, tuple[int, float]] = {}
    ttft: list[float] = []
    cached: list[int] = []
    prompt_tokens = output_tokens = 0
    counter = 0

    def ask(user: int) -> None:
        nonlocal counter, prompt_tokens
        histories[user] += tokens(seed * 1000 + 100 * user + rounds_left[user] + 50, job["question_tokens"])
        request_id = f"s{seed}u{user}q{counter}"
        counter += 1
        engine.add_request(request_id, {"prompt_token_ids": list(histories[user])}, params)
        submitted[request_id] = (user, time.perf_counter())
        prompt_tokens += len(histories[user])

    started = time.perf_counter()
    for user in range(job["users"]):
        ask(user)
    first_seen: set[str] = set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            user, asked = submitted[output.request_id]
            if output.outputs[0].token_ids and output.request_id not in first_seen:
                first_seen.add(output.request_id)
                ttft.append(time.perf_counter() - asked)
            if output.finished:
                answer = list(output.outputs[0].token_ids)
                histories[user] += answer
                output_tokens += len(answer)
                cached.append(output.num_cached_tokens or 0)
                rounds_left[user] -= 1
                if rounds_left[user]:
                    ask(user)
    return {"name": session["name"], "seconds": time.perf_counter() - started, "ttft": ttft,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "cached_tokens": sum(cached)}


def spawn(job: dict[str, Any], directory: Path, name: str, module: str = MODULE) -> dict[str, Any]:
    """Run ``python -m MODULE --engine JOB`` (its engine_run) in a fresh process: what it wrote, or
    {"error": why}."""
    from tests.support.paths import ROOT

    job = {**job, "out": str(directory / f"{name}.json")}
    path = directory / f"{name}-job.json"
    path.write_text(json.dumps(job))
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run([sys.executable, "-m", module, "--engine", str(path)], cwd=ROOT, env=environment,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if completed.returncode or not Path(job["out"]).exists():
        lines = [line for line in completed.stderr.splitlines() if line.strip()] or ["no output"]
        print(f"the {name} engine failed:\n{completed.stderr[-6000:]}", file=sys.stderr)
        return {"error": f"the engine exited {completed.returncode}: {lines[-1]}"}
    result: dict[str, Any] = json.loads(Path(job["out"]).read_text())
    return result


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=768)
    parser.add_argument("--context-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=240)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=512, help="vLLM's own KV space (MiB)")
    parser.add_argument("--model", choices=list(MODELS), default="llama-like")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="vLLM's own prefix cache (default: off for llama-like, on for the hybrid)")
    parser.add_argument("--repeats", type=int, default=2, help="sessions per variant, interleaved")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_run(json.loads(Path(args.engine).read_text()))
        return
    from benchmarks.support import models
    from benchmarks.support.unmeasured import Unmeasured

    model = MODELS[args.model]
    if args.prefix_caching is None:
        args.prefix_caching = model["prefix_caching"]
    job = {key: getattr(args, key) for key in ("users", "rounds", "system_tokens", "context_tokens",
                                                "question_tokens", "answer_tokens", "kv_mib", "prefix_caching")}
    job.update(engine=model["engine"], chunk=model["chunk"])
    with tempfile.TemporaryDirectory(prefix="kvgroups-vllm-serving-") as temporary:
        directory = Path(temporary)
        getattr(models, model["save"])(directory / "model")
        job["model"] = str(directory / "model")
        kvgroups = spawn({**job, "connector": "kvgroups", "store": f"file://{directory}/kv", "sessions": [
            session for repeat in range(args.repeats) for session in (
                {"name": "connector", "seed": 10 + 2 * repeat},
                {"name": "connector, loads off (all miss)", "seed": 11 + 2 * repeat,
                 "kv_transfer_params": OFF_LOADS})]}, directory, "kvgroups")
        plain = spawn({**job, "connector": None, "sessions": [
            {"name": "no connector", "seed": 10 + 2 * repeat} for repeat in range(args.repeats)]}, directory, "plain")
        offloading = spawn({**job, "connector": "offloading", "sessions": [{"name": "offloading", "seed": 10}]},
                           directory, "offloading")
    by_name: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    not_run: dict[str, str] = {}
    for result, names in ((plain, ["no connector"]), (kvgroups, ["connector", "connector, loads off (all miss)"])):
        for session in result.get("sessions", []):
            by_name[session["name"]].append(session)
        if "error" in result:
            not_run.update(dict.fromkeys(names, result["error"]))
    print(f"{args.model}, {args.users} users x {args.rounds} rounds: system prompt {args.system_tokens} tokens "
          f"(shared), context {args.context_tokens}, questions {args.question_tokens}, answers {args.answer_tokens}; "
          f"vLLM's prefix cache {'on' if args.prefix_caching else 'off'}, {args.kv_mib} MiB of KV "
          f"(attention K/V of {(args.kv_mib << 20) // model['kv_bytes_per_token']} tokens); medians over "
          f"{args.repeats} sessions per variant\n")
    print("| variant | wall s | prompt tokens/s | output tokens/s | TTFT p50 s | TTFT p90 s | cached tokens / prompt "
          "tokens | connector ms per scheduler step (mean / p99) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, sessions in by_name.items():
        wall = statistics.median(session["seconds"] for session in sessions)
        ttfts = [value for session in sessions for value in session["ttft"]]
        steps = [value * 1e3 for session in sessions for value in session.get("connector_seconds_per_step", [])]
        clock = f"{statistics.mean(steps):.3f} / {percentile(steps, 0.99):.3f}" if steps else "-"
        print(f"| {name} | {wall:.1f} | {sessions[0]['prompt_tokens'] / wall:.0f} | "
              f"{sessions[0]['output_tokens'] / wall:.1f} | {percentile(ttfts, 0.5):.2f} | "
              f"{percentile(ttfts, 0.9):.2f} "
              f"| {sessions[0]['cached_tokens'] / sessions[0]['prompt_tokens']:.2f} | {clock} |")
    unmeasured = Unmeasured()
    for name, error in not_run.items():
        print(unmeasured.row(name, error, columns=8))
    if "error" in offloading:
        # vLLM's own CPU tier refuses vLLM's CPU platform (its spec.py); any other failure is one.
        print(unmeasured.row("vLLM OffloadingConnector (CPU tier)", offloading["error"], columns=8,
                             available_elsewhere=OFFLOADING_REFUSES_CPU in offloading["error"]))
    unmeasured.exit()


if __name__ == "__main__":
    main()
