"""Engine jobs in processes forked from one that has imported vLLM already: a process of their own each, without
their twelve seconds of imports.

An in-process engine of a tiny model costs about 15 s on this project's 2-core machines, 12 of them importing vLLM,
torch and transformers, and the vLLM suite runs dozens. ``python -m tests.integrations.vllm.engine_zygote`` imports
vLLM's engine modules once, then reads jobs on stdin (a JSON line each: the job file, the environment, the log) and
forks a child per job: the child leaves the zygote's session and pipes, takes the job's environment and writes its
output to the job's log, then runs ``engine_runner.main`` and exits as ``python -m
tests.integrations.vllm.engine_runner JOB.json`` does (atexit handlers, vLLM's shutdown of a multiprocess engine's
core). The zygote answers each job with the child's pid, then its exit code.

What a fork carries over is kept to imports: the zygote builds no engine, runs no torch operation (no thread pool
started) and never imports kvgroups (vLLM 0.32 cannot build an engine in a process where llvmlite, numba's compiler,
was loaded before its Triton kernels were rebound). Environment variables read at import time are the zygote's, the
same for every job (``TORCHDYNAMO_DISABLE``); vLLM reads its own when they are used. On a CUDA machine, use plain
processes: CUDA does not survive a fork once initialized.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from typing import Any, TextIO

# vLLM's engine, its CPU worker and attention, the test models' classes: what every job would import.
PRELOAD = (
    "torch", "transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
    "vllm.v1.engine.core_client", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn", "vllm.v1.core.sched.scheduler",
    "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "vllm.model_executor.models.gemma3",
    "vllm.model_executor.models.qwen3_next", "vllm.model_executor.models.granitemoehybrid",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
)


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as error:  # another vLLM release: that job imports it itself
            print(f"engine_zygote: not preloaded: {name}: {error}", file=sys.stderr, flush=True)
    assert "numba" not in sys.modules and "llvmlite" not in sys.modules, "the zygote must not load llvmlite"


def _answer(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def serve(requests: TextIO, answers: TextIO) -> dict[str, Any] | None:
    """Fork a child per request: in the zygote, None once its client is gone; in a child, its request."""
    while line := requests.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return dict(request)
        _answer(answers, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer(answers, {"exit": os.waitstatus_to_exitcode(status)})
    return None


def become(request: dict[str, Any]) -> None:
    """The child: a session of its own (its client kills it by its group), the job's environment and output."""
    os.setsid()
    os.environ.clear()
    os.environ.update(request["environment"])
    tempfile.tempdir = None  # the job's TMPDIR, not the one the zygote's imports may have cached
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.argv = ["engine_runner", request["job"]]


if __name__ == "__main__":
    preload()
    job = serve(sys.stdin, sys.stdout)
    if job is not None:
        become(job)
        from tests.integrations.vllm import engine_runner

        engine_runner.main()
