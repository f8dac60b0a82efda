"""``vllm serve`` processes the serving benchmarks start, stop, kill and start again: each in a process group of its
own on CPUs of its own, on a port outside the kernel's ephemeral range (``tests/support/ports.py``), its sockets and
rendezvous files in its own directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.support.paths import ROOT
from tests.support.ports import health_answered, serve_on_free_port, stop_process_group

RESTART_NICENESS = -10


class VllmServer:
    """One ``vllm serve`` in a process group of its own, started (and started again) on demand; a subclass says
    its command line."""

    def __init__(self, name: str, model: Path, store: list[str], directory: Path, kv_bytes: int,
                 cpus: list[int]) -> None:
        self.name, self.model, self.store, self.directory = name, model, store, directory
        self.kv_bytes, self.cpus = kv_bytes, cpus
        self.port = 0  # each start's own
        self.process: subprocess.Popen[bytes] | None = None
        self.incarnation = 0
        self.up = threading.Event()
        self.started_at = 0.0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int) -> list[str]:
        """The server's command line on ``port``: each benchmark's own models, options and connector settings."""
        raise NotImplementedError

    def start(self) -> None:
        # Each server on CPUs of its own: left to bind itself, every vLLM CPU engine pins its worker to the
        # first CPU, and a server started again beside a busy one waits minutes there for its turn.
        # No VLLM_CPU_KVCACHE_SPACE: set, it overrides --kv-cache-memory-bytes on vLLM's CPU platform, and a
        # KV space of 1 GiB kept every conversation in vLLM's own prefix cache (the store served almost nothing).
        environment = {name: value for name, value in os.environ.items() if name != "VLLM_CPU_KVCACHE_SPACE"}
        self.incarnation += 1
        # Its sockets and rendezvous files in the server's directory (the benchmark removes it), not left in /tmp.
        scratch = self.directory / f"{self.name}-{self.incarnation}-tmp"
        scratch.mkdir()
        environment.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, self.cpus)), TMPDIR=str(scratch),
                           PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        # Started again beside the other server's busy engine on a small machine, a server gets a few per cent
        # of a CPU and takes many minutes to start: it starts ahead of the other (as on a machine of its own),
        # then serves at the same priority.
        ahead = ["nice", "-n", str(RESTART_NICENESS)] if self.incarnation > 1 else []

        def started(process: subprocess.Popen[bytes]) -> None:
            self.process = process
            if ahead:
                self._autogroup_niceness(RESTART_NICENESS)

        # A port of its own each start: the one it had may have been taken while it was down.
        process, self.port = serve_on_free_port(
            lambda port: [*ahead, *self.command(port)], self.directory / f"{self.name}-{self.incarnation}.log",
            ready=health_answered, seconds=600, what=f"{self.name}'s vllm serve", started=started, cwd=ROOT,
            env=environment)
        self.process = process
        os.setpriority(os.PRIO_PGRP, process.pid, 0)  # every thread of every process in its group
        self._autogroup_niceness(0)
        self.started_at = time.monotonic()
        self.up.set()

    def _autogroup_niceness(self, niceness: int) -> None:
        """Where the kernel groups each session's threads (sched_autogroup), the group's niceness is what
        shares the CPUs between the servers; a process's own is only felt inside its group."""
        if self.process is not None:
            with contextlib.suppress(OSError):
                Path(f"/proc/{self.process.pid}/autogroup").write_text(str(niceness))

    def kill(self) -> None:
        self.up.clear()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self) -> None:
        self.up.clear()
        if self.process is not None:
            stop_process_group(self.process, grace_seconds=60)
