"""A throwaway Valkey/Redis server for the benchmarks: a free loopback port, no persistence, stopped after."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def local_redis(directory: Path) -> Iterator[str | None]:
    """A ``redis://`` URL of a server running in ``directory``, or None where none is installed."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):  # up to 10 s to accept connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.kill()
        server.wait()
