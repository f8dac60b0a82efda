"""The stores the SGLang backend's tests run on: a file store, or a real Valkey/Redis server, Redis Cluster or
Mooncake Store pool (each started once per test module, by conftest.py's fixtures), emptied for each test."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from kvgroups.store import open_store
from tests.support.servers import Cluster, Server

KINDS = ("file", "redis", "redis-cluster", "mooncake")


def fresh_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The URL of an empty store of ``kind``."""
    if kind == "file":
        return f"file://{tmp_path}/kv"
    if kind == "redis":
        server: Server = request.getfixturevalue("server")
        redis.Redis.from_url(server.url).flushall()
        return server.url + "?timeout=10"  # slowness on a loaded machine is not what these tests test
    if kind == "mooncake":
        pool: str = request.getfixturevalue("mooncake_pool")
        with open_store(pool) as store:
            store.clear()
        return pool
    cluster: Cluster = request.getfixturevalue("cluster")
    open_store(cluster.url).clear()
    return cluster.url + "?timeout=10"
