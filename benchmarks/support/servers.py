"""The benchmarks' Valkey/Redis servers: the test suite's own (``tests/support/servers.py``), or none where no
server is installed (the benchmark then leaves its Redis rows out)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.servers import installed_server, running_cluster, running_server

__all__ = ["installed_server", "local_cluster", "local_redis", "running_cluster", "running_server"]


@contextmanager
def local_redis(directory: Path) -> Iterator[str | None]:
    """A ``redis://`` URL of a server running in ``directory``, or None where none is installed."""
    if installed_server() is None:
        yield None
        return
    with running_server(directory) as server:
        yield server.url


@contextmanager
def local_cluster(directory: Path) -> Iterator[str | None]:
    """A ``redis-cluster://`` URL of a 3-master, 3-replica cluster in ``directory``, or None where no
    server is installed."""
    if installed_server() is None:
        yield None
        return
    with running_cluster(directory) as cluster:
        yield cluster.url
