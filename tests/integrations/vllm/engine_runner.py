"""Run one vLLM engine in a process of its own, phase after phase, and write what each request produced.

``run_job`` runs it in a process forked from the engine zygote (``engine_zygote``: vLLM imported already), or in
``python -m tests.integrations.vllm.engine_runner JOB.json``, where the job is ``{"model": dir,
"dtype": ..., "connector": extra_config or null, "phases": [{"requests": [{"prompt_token_ids":
[...], "cache_salt": ...}], "before": {"stop_pid": pid}, "max_tokens": n, "kv_transfer_params": {...}
(each optional)}], "out": path, "store_dir": dir (optional)}``. Greedy, with logprobs, vLLM's
prefix cache off unless ``"prefix_caching": true``. With ``store_dir`` (a file store), each phase's
result lists the keys the store holds after it, its saves written. A phase with ``"reply_then":
[[tokens], ...]`` instead of requests is a conversation's next turn: each request of the phase before
it, followed by its reply and those tokens. Optional: ``"speculative_config"`` (vLLM's, such as
``{"method": "ngram", "num_speculative_tokens": 3}``), ``"prefix_cache_retention_interval"`` (vLLM's),
``"attention_backend"`` (a vLLM backend name), ``"kv_events"`` (``{"endpoint": ..., "topic": ...}``: KV events published
over ZMQ), ``"mamba_ssm_cache_dtype"``, ``"cpu_attention_kernels": "vec"``, which keeps vLLM's
CPU attention on its vec kernels on CPUs with AMX too (an in-process engine only), so that a
bfloat16 job runs the same kernels on every x86 CPU, and ``"mamba2_checkpoint_export": false``
(an in-process engine only), which runs vLLM's Mamba-2 mixer without exporting a prefix-cache
checkpoint from inside its forward: vLLM's CPU build fails there (``IndexError`` in
``mamba_mixer2.conv_ssm_forward``, its CPU scan returns no intermediate states), and without it
vLLM's scheduler ends a step at the checkpoint instead, as it does for gated DeltaNet. An
in-process engine's result also holds the connector's own counts (``connector_counts``, since
the engine started).

One engine per process, as deployments run them: vLLM 0.32 cannot build a second engine in a
process that has loaded llvmlite (numba's compiler, which the connector's CPU kernel uses): its
Triton kernel rebinding scans every module and trips over llvmlite's function table.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.paths import ROOT
from tests.support.scratch import scratch_directory

JOB_SECONDS = 600


def _environment() -> dict[str, str]:
    return {
        # This checkout's source first, whatever kvgroups the environment has installed.
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        # Lets the runner ask the workers to finish their queued saves (a test-only RPC).
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        # vLLM's sampler compiles its logprobs gather (a top-k and a gather: exact either way) with Dynamo
        # at an engine's first step with logprobs, about 3 s of every engine process on this VM; the
        # model itself runs eager (enforce_eager) in every job.
        "TORCHDYNAMO_DISABLE": "1",
    }


def run_job(job: dict[str, Any], directory: Path, name: str, *, multiprocess: bool,
            forked: bool = True) -> list[dict[str, Any]]:
    """Run ``job`` (its phases) in a process of its own: each phase's result. The process is forked from the
    engine zygote (``engine_zygote``: vLLM imported already), or with ``forked=False`` a fresh interpreter
    (``python -m tests.integrations.vllm.engine_runner``; on a CUDA machine). Raises RuntimeError holding the end
    of the process's output when it fails."""
    import subprocess

    job = {**job, "out": str(directory / f"{name}.json")}
    job_path = directory / f"{name}-job.json"
    job_path.write_text(json.dumps(job))
    log = directory / f"{name}.log"
    with scratch_directory() as scratch:  # the engine's sockets and rendezvous file, removed with it
        environment = {**_environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                       "TMPDIR": scratch}
        if forked:
            code = _zygote().run(job_path, environment, log, JOB_SECONDS)
        else:
            with open(log, "wb") as output:
                code = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.engine_runner", str(job_path)],
                                      cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT,
                                      timeout=JOB_SECONDS, check=False).returncode
    if code != 0:
        raise RuntimeError(f"engine {name} exited {code}:\n{log.read_text(errors='replace')[-4000:]}")
    return list(json.loads(Path(job["out"]).read_text()))


class _Zygote:
    """The client of one engine zygote (a process of its own, started on first use): one job at a time."""

    def __init__(self) -> None:
        import subprocess

        environment = _environment()
        environment.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.process = subprocess.Popen([sys.executable, "-m", "tests.integrations.vllm.engine_zygote"], cwd=ROOT,
                                        env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self._unread = b""

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, job: Path, environment: dict[str, str], log: Path, seconds: float) -> int:
        """The job's exit code; a job past ``seconds`` is killed (its process group) and raises TimeoutExpired."""
        import subprocess

        assert self.process.stdin is not None
        with self.lock:
            request = {"job": str(job), "environment": environment, "log": str(log)}
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            deadline = time.monotonic() + seconds
            pid = int(self._answer(deadline)["pid"])
            try:
                return int(self._answer(deadline)["exit"])
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self._answer(time.monotonic() + 60)
                raise

    def _answer(self, deadline: float) -> dict[str, Any]:
        """The zygote's next line, read from its pipe unbuffered (a buffer would hide a line from select)."""
        import select
        import subprocess

        assert self.process.stdout is not None
        descriptor = self.process.stdout.fileno()
        while b"\n" not in self._unread:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([descriptor], [], [], remaining)[0]:
                raise subprocess.TimeoutExpired("an engine job", JOB_SECONDS)
            data = os.read(descriptor, 65536)
            if not data:
                raise RuntimeError(f"the engine zygote exited with {self.process.wait()}")
            self._unread += data
        line, self._unread = self._unread.split(b"\n", 1)
        return dict(json.loads(line))


_zygotes: list[_Zygote] = []
_zygote_lock = threading.Lock()


def _zygote() -> _Zygote:
    with _zygote_lock:
        if not _zygotes or not _zygotes[0].alive():
            _zygotes[:] = [_Zygote()]
        return _zygotes[0]


def outputs(phase: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    """A phase's greedy tokens and their logprobs, per request."""
    return [(output["token_ids"], output["logprobs"]) for output in phase["outputs"]]


def _engine(job: dict[str, Any], connector: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {}
    if connector is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=connector, kv_load_failure_policy="recompute",
        )
    if "kv_events" in job:  # {"endpoint": ..., "topic": ...}: vLLM publishes its KV events over ZMQ there
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **job["kv_events"])
    if "attention_backend" in job:
        extra["attention_config"] = {"backend": job["attention_backend"]}
    if "prefix_cache_retention_interval" in job:  # null: vLLM's prefix cache keeps every recurrent state
        extra["prefix_cache_retention_interval"] = job["prefix_cache_retention_interval"]
    if "speculative_config" in job:  # e.g. {"method": "ngram", "num_speculative_tokens": 3, ...}
        extra["speculative_config"] = job["speculative_config"]
    return LLM(model=job["model"], dtype=job.get("dtype", "float32"), block_size=job.get("block_size", 32),
               enforce_eager=True, enable_prefix_caching=job.get("prefix_caching", False),
               max_model_len=job.get("max_model_len", 2048),
               max_num_seqs=4, max_num_batched_tokens=job.get("max_num_batched_tokens", 2048), seed=0,
               mamba_ssm_cache_dtype=job.get("mamba_ssm_cache_dtype", "auto"), **extra)


def _stored_keys(directory: str) -> list[str]:
    from kvgroups.store import FileStore

    if not Path(directory).exists():
        return []
    return sorted(FileStore(directory).iter_keys())


def _keys_at(url: str) -> list[str]:
    from kvgroups.store import open_store

    try:
        with open_store(url) as store:
            return sorted(store.iter_keys())
    except OSError:  # a server the job stopped
        return []


def _connector_counts(engine: Any) -> dict[str, int] | None:
    """The scheduler side's own counts of an in-process engine's connector (None elsewhere)."""
    import dataclasses

    core = getattr(getattr(engine.llm_engine, "engine_core", None), "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    side = getattr(connector, "_scheduler", None)
    return dataclasses.asdict(side.counts) if side is not None else None


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    if job.get("cpu_attention_kernels") == "vec":
        import torch

        # vLLM picks its amx kernels (tile-packed pages) when this says yes.
        torch.cpu._is_amx_tile_supported = lambda: False
    from vllm import SamplingParams

    if job.get("mamba2_checkpoint_export") is False:
        from vllm.model_executor.layers.mamba import abstract, mamba_mixer2

        mamba_mixer2.MambaMixer2.get_kv_cache_spec = abstract.MambaBase.get_kv_cache_spec
    engine = _engine(job, job.get("connector"))
    results: list[dict[str, Any]] = []
    for given in job["phases"]:
        phase = given
        if "reply_then" in given:  # a conversation's next turn: each earlier prompt, its reply, a new message
            phase = {**given, "requests": [
                {**asked, "prompt_token_ids": [*asked["prompt_token_ids"], *answer["token_ids"], *message]}
                for asked, answer, message in zip(results[-1]["requests"], results[-1]["outputs"],
                                                  given["reply_then"], strict=True)]}
        before = phase.get("before", {})
        if "stop_pid" in before:
            os.kill(before["stop_pid"], signal.SIGKILL)
            time.sleep(0.2)
        transfer = phase.get("kv_transfer_params")  # e.g. {"kvgroups": {"load": false, "save": false}}
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", job.get("max_tokens", 8)),
                                logprobs=2, ignore_eos=True,
                                extra_args={"kv_transfer_params": transfer} if transfer else None)
        started = time.perf_counter()
        outputs = engine.generate(phase["requests"], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        if job.get("connector") is not None:
            from kvgroups.integrations.vllm import flush_saves

            assert all(engine.collective_rpc(flush_saves))
        results.append({
            "requests": phase["requests"],
            "seconds": elapsed,
            # The block size vLLM settled on (for a hybrid it sizes attention blocks to hold a state).
            "block_size": engine.llm_engine.vllm_config.cache_config.block_size,
            "outputs": [{
                "token_ids": list(output.outputs[0].token_ids),
                "logprobs": [entry[token].logprob for token, entry in
                             zip(output.outputs[0].token_ids, output.outputs[0].logprobs, strict=True)],
                "num_cached_tokens": output.num_cached_tokens,
            } for output in outputs],
        })
        counts = _connector_counts(engine)
        if counts is not None:
            results[-1]["connector_counts"] = counts
        if "store_dir" in job:
            results[-1]["store_keys"] = _stored_keys(job["store_dir"])
        elif "store_url" in job:
            results[-1]["store_keys"] = _keys_at(job["store_url"])
        Path(job["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
