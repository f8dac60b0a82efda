"""A real Mooncake master for the tests and benchmarks, and clients in processes of their own that lend it memory.

The master (``mooncake_master``, from the ``mooncake`` extra) listens on loopback ports outside the kernel's
ephemeral range: its RPC port, its admin server (``/health``, ``/get_all_keys``) and its HTTP metadata
server; it is started again on other ports where one was taken (it exits then, not always saying why).
A lender (:func:`lending_client`) is a Python process whose store lends a segment to the pool and holds
it until it is killed, as a serving engine's process would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.ports import PortTakenError, start_on_free_ports

START_SECONDS = 60.0
# How long the master keeps a client it no longer hears from (its segments, and the entries in them): short,
# so that a test of a client killed sees its entries go within seconds.
CLIENT_TTL_SECONDS = 2


def master_binary() -> str:
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found:
        return found
    if os.environ.get("KVGROUPS_SKIP_MOONCAKE") == "1":
        pytest.skip("no mooncake_master (KVGROUPS_SKIP_MOONCAKE=1)")
    raise RuntimeError("the Mooncake tier's tests need Mooncake: pip install 'kvgroups[mooncake]' (make test does)")


class MooncakeMaster:
    """One ``mooncake_master`` process; :meth:`url` is a ``mooncake://`` URL of it for kvgroups' open_store."""

    def __init__(self, directory: Path, *, settings: tuple[str, ...] = ()) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.log = directory / "master.log"
        self.rpc_port = self.admin_port = self.metadata_port = 0
        start_on_free_ports(lambda ports: self._start(*ports), count=3, what="a Mooncake master")

    def _start(self, rpc_port: int, admin_port: int, metadata_port: int) -> None:
        self.rpc_port, self.admin_port, self.metadata_port = rpc_port, admin_port, metadata_port
        arguments = [master_binary(), f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1",
                     f"--metrics_port={admin_port}", "--metrics_host=127.0.0.1", "--enable_http_metadata_server=true",
                     f"--http_metadata_server_port={metadata_port}", "--http_metadata_server_host=127.0.0.1",
                     f"--client_ttl={CLIENT_TTL_SECONDS}", "--rpc_thread_num=4", *self.settings]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(arguments, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_SECONDS
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    # It exits when a port is taken (the RPC port without saying so): started again elsewhere.
                    raise PortTakenError(f"the Mooncake master exited at start with {self.process.returncode}")
                if self._ready():
                    time.sleep(0.2)  # a taken RPC port ends it just after its admin server answers
                    if self.process.poll() is None:
                        return
                time.sleep(0.05)
            raise RuntimeError(f"the Mooncake master did not start within {START_SECONDS:.0f} s")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/health", timeout=2) as answer:
                return bool(json.loads(answer.read()).get("service_ready"))
        except (OSError, ValueError):
            return False

    def url(self, *, segment: str = "64MiB", metadata: bool = False, timeout: float = 2.0, **options: object) -> str:
        """A URL of this master; ``metadata`` uses its HTTP metadata server rather than peers' handshakes."""
        query = {"segment": segment, "local_host": "127.0.0.1", "admin": f"http://127.0.0.1:{self.admin_port}",
                 "timeout": f"{timeout:g}", **{name: str(value) for name, value in options.items()}}
        if metadata:
            query["metadata"] = f"http://127.0.0.1:{self.metadata_port}/metadata"
        return f"mooncake://127.0.0.1:{self.rpc_port}?" + "&".join(f"{name}={value}" for name, value in query.items())

    def stored_keys(self) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/get_all_keys", timeout=5) as answer:
            return answer.read().decode().split()

    def pause(self) -> None:
        """Hang the master (SIGSTOP): it holds its connections and answers nothing."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Kill the master and start it again on the same ports (with nothing of what it knew)."""
        self.stop()
        self._start(self.rpc_port, self.admin_port, self.metadata_port)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=30)


@contextmanager
def running_master(directory: Path, **options: object) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(directory, **options)  # type: ignore[arg-type]
    try:
        yield master
    finally:
        master.stop()


_LENDER = """
import sys, time
from kvgroups.store import open_store
store = open_store(sys.argv[1])
if not store.client.wait_ready(60):
    sys.exit("the lending client did not connect")
print("lending", flush=True)
while True:
    time.sleep(1)
"""


@contextmanager
def lending_client(url: str) -> Iterator[subprocess.Popen[str]]:
    """A process of its own whose store (``url``, with the segment it lends) is in the pool until it is killed."""
    process = subprocess.Popen([sys.executable, "-c", _LENDER, url], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if line.strip() != "lending":
            raise RuntimeError(f"the lending client did not start (exit {process.poll()})")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
