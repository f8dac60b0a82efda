"""The SGLang backend's tests need SGLang: they run in the environment `make test-sglang` builds (.venv-sglang).
The Valkey/Redis server and cluster, and the Mooncake master with a process lending it memory, that they store
in are started once per test module."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.support.mooncake import lending_client, running_master
from tests.support.servers import Cluster, Server, running_cluster, running_server

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.integrations.sglang import torchvision_stand_in

    torchvision_stand_in.install()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("valkey")) as started:
        yield started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster"), replicas=0) as started:
        yield started


@pytest.fixture(scope="module")
def mooncake_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Mooncake pool whose memory another process lends (as another server would): the URL of a client that
    lends none, so that what a cache stored outlives the cache."""
    with running_master(tmp_path_factory.mktemp("mooncake")) as master, \
            lending_client(master.url(segment="256MiB", timeout=10)):
        yield master.url(segment="0", timeout=10)
