"""Real Valkey/Redis servers for the tests: started on a free loopback port or a unix socket, stopped after."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SERVERS = ("valkey-server", "redis-server")


def installed_server() -> str | None:
    """The path of valkey-server (preferred) or redis-server, None where neither is installed."""
    for name in SERVERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def server_binary() -> str:
    found = installed_server()
    if found:
        return found
    if os.environ.get("KVGROUPS_SKIP_REDIS") == "1":
        pytest.skip("no valkey-server or redis-server (KVGROUPS_SKIP_REDIS=1)")
    raise RuntimeError("the Redis tier's tests need a real server: apt-get install redis-server (make test does)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """One server process; ``url`` is a redis:// or unix:// URL for kvgroups' open_store."""

    def __init__(self, directory: Path, *, unix: bool = False, settings: tuple[str, ...] = (),
                 port: int | None = None) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "server.log"
        self.port = 0 if unix else port or free_port()
        self.socket = directory / "server.sock" if unix else None
        arguments = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(directory), "--daemonize", "no", *settings]
        if self.socket is not None:
            arguments += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(arguments, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"unix://{self.socket}" if self.socket is not None else f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited at start with code {self.process.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                if self.socket is not None:
                    if self.socket.exists():
                        with socket.socket(socket.AF_UNIX) as probe:
                            probe.connect(str(self.socket))
                            return
                else:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("the server did not start within 10 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@contextmanager
def running_server(directory: Path, **options: object) -> Iterator[Server]:
    server = Server(directory, **options)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
