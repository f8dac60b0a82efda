"""The ports every test server starts on (tests/support/ports.py): outside the kernel's ephemeral range, and a
start whose port is taken under it goes on with other ports, leaving nothing behind when it cannot."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.support import ports
from tests.support.ports import PortTakenError, ignores_sigint, serve_on_free_port, stop_process_group
from tests.support.servers import Cluster, Server, installed_server


def processes_naming(text: str) -> list[int]:
    """The pids of live processes whose command line names ``text``."""
    found = []
    for process in ports.running_processes():
        with contextlib.suppress(OSError):
            if text in Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(process.pid)
    return found


def live_children() -> set[int]:
    """This process's children that have not exited (Valkey/Redis retitle themselves: their command lines
    name no directory of the test's)."""
    return {process.pid for process in ports.running_processes() if process.parent == os.getpid()}


def hold(port: int) -> socket.socket:
    """A listening socket on ``port``, as another process's server would hold it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    return holder


class TakesPorts:
    """Wraps subprocess.Popen: just before chosen Valkey/Redis servers start, their port (``taken="port"``) or
    their cluster bus port (``"bus"``) is taken by another socket, as a connection or a server of another
    process takes a port between the moment it was found free and the server's bind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, taken: str, which: Any) -> None:
        self.taken, self.which = taken, which
        self.started = 0
        self.held: list[socket.socket] = []
        self.ports_taken: list[int] = []
        self._popen = subprocess.Popen
        monkeypatch.setattr(subprocess, "Popen", self)

    def __call__(self, arguments: list[str], *args: Any, **kwargs: Any) -> Any:
        if arguments and arguments[0] == installed_server():
            self.started += 1
            if self.which(self.started):
                port = int(arguments[arguments.index("--port") + 1])
                port += ports.CLUSTER_BUS_OFFSET if self.taken == "bus" else 0
                self.held.append(hold(port))
                self.ports_taken.append(port)
        return self._popen(arguments, *args, **kwargs)

    def close(self) -> None:
        for holder in self.held:
            holder.close()


@pytest.fixture
def takes_ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    made: list[TakesPorts] = []

    def make(taken: str, which: Any) -> TakesPorts:
        made.append(TakesPorts(monkeypatch, taken, which))
        return made[-1]

    yield make
    for each in made:
        each.close()


needs_redis = pytest.mark.skipif(installed_server() is None, reason="no valkey-server or redis-server")


def test_ports_lie_outside_the_ephemeral_range_bus_ports_too(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL
    (tmp_path / "range").write_text("32768\t60999\n")
    ephemeral = ports.ephemeral_range(tmp_path / "range")
    assert ephemeral == (32768, 60999)
    single = ports.candidate_ports(ephemeral=ephemeral)
    assert single[0] == ports.LOWEST_PORT and single[-1] == 65535
    assert not [port for port in single if 32768 <= port <= 60999]
    bus = ports.candidate_ports(ports.CLUSTER_BUS_OFFSET, ephemeral=ephemeral)
    assert bus == list(range(ports.LOWEST_PORT, 32768 - ports.CLUSTER_BUS_OFFSET))
    # A machine lending every port to connections: any port, the starts' retries carrying the rest.
    assert ports.candidate_ports(ports.CLUSTER_BUS_OFFSET, ephemeral=(1024, 65535))[-1] == 65535 - 10000
    # What this machine's range leaves.
    low, high = ports.ephemeral_range()
    for port in ports.free_ports(20, bus_offset=ports.CLUSTER_BUS_OFFSET):
        assert not low <= port <= high and not low <= port + ports.CLUSTER_BUS_OFFSET <= high


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    *busy, free = ports.free_ports(4)
    with ExitStack() as stack:
        for port in busy:
            stack.enter_context(hold(port))
        monkeypatch.setattr(ports, "candidate_ports", lambda bus_offset=None, ephemeral=None: [*busy, free])
        assert ports.free_ports(1) == [free]
        with pytest.raises(RuntimeError, match="no 2 free loopback ports"):
            ports.free_ports(2)


@needs_redis
def test_a_server_whose_port_is_taken_under_it_starts_on_another(takes_ports: Any, tmp_path: Path) -> None:
    before = live_children()
    taking = takes_ports("port", lambda started: started == 1)
    server = Server(tmp_path / "server")
    try:
        assert taking.started == 2 and server.port not in taking.ports_taken
        assert live_children() - before == {server.process.pid}
    finally:
        server.stop()


@needs_redis
def test_a_cluster_whose_bus_port_is_taken_under_it_starts_on_other_ports(takes_ports: Any, tmp_path: Path) -> None:
    # The third node's bus port taken between the choice and the bind, as in the CI run that failed:
    # "Could not create server TCP listening socket 127.0.0.1:56604: bind: Address already in use".
    before = live_children()
    taking = takes_ports("bus", lambda started: started == 3)
    cluster = Cluster(tmp_path / "cluster", masters=3, replicas=0)
    try:
        assert len(cluster.masters()) == 3 and taking.started == 6
        assert taking.ports_taken[0] - ports.CLUSTER_BUS_OFFSET not in cluster.ports
        # The two nodes started before the failure did not outlive it: the cluster's three are all there is.
        assert live_children() - before == {node.process.pid for node in cluster.nodes.values()}
    finally:
        cluster.stop()
    assert live_children() == before


@needs_redis
def test_a_cluster_start_that_fails_anyway_leaves_no_process_behind(takes_ports: Any, tmp_path: Path) -> None:
    before = live_children()
    taking = takes_ports("bus", lambda started: started % 3 == 0)  # every start's third node
    with pytest.raises(PortTakenError, match="a cluster found its ports taken in each of 8 starts"):
        Cluster(tmp_path / "cluster", masters=3, replicas=0)
    assert taking.started == 3 * ports.STARTS
    assert live_children() == before


SERVER = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]


def answers(port: int) -> bool:
    """The test server's answer, not a connection: whoever took its port accepts connections too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=0.5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def test_a_process_whose_port_is_taken_under_it_starts_on_another(tmp_path: Path) -> None:
    held: list[socket.socket] = []

    def command(port: int) -> list[str]:
        if not held:
            held.append(hold(port))
        return [*SERVER, str(port)]

    try:
        process, port = serve_on_free_port(command, tmp_path / "server.log", ready=answers, seconds=60,
                                           what="a test server", cwd=tmp_path)
        try:
            assert port != held[0].getsockname()[1] and process.poll() is None
        finally:
            stop_process_group(process)
    finally:
        held[0].close()


def test_a_process_start_that_fails_anyway_leaves_no_process_behind(tmp_path: Path) -> None:
    held: list[socket.socket] = []

    def command(port: int) -> list[str]:
        held.append(hold(port))
        # A server that starts a child of its own, then fails to bind: the child must not outlive the start.
        bind = f"import socket; socket.socket().bind(('127.0.0.1', {port}))"
        return ["sh", "-c", f'sleep 6007 & exec {sys.executable} -S -c "{bind}"']

    try:
        with pytest.raises(PortTakenError, match="found its ports taken in each of 8 starts"):
            serve_on_free_port(command, tmp_path / "server.log", ready=lambda port: False, seconds=60,
                               what="a test server", cwd=tmp_path)
        assert len(held) == ports.STARTS
        assert not processes_naming("sleep 6007")
    finally:
        for holder in held:
            holder.close()


@pytest.mark.parametrize("sigint", ["taken", "ignored"])
def test_a_server_is_stopped_by_the_signal_it_takes_not_left_to_the_kill(sigint: str) -> None:
    """SIGINT where the server takes it; where it ignores SIGINT (everything a non-interactive shell's background
    job starts does), SIGTERM: never the grace waited out and SIGKILL."""
    handler = "signal.SIG_IGN" if sigint == "ignored" else "signal.default_int_handler"
    code = f"import signal, time; signal.signal(signal.SIGINT, {handler}); print('up', flush=True); time.sleep(600)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"up\n"
        assert ignores_sigint(process.pid) == (sigint == "ignored")
        stop_process_group(process, grace_seconds=60)
        assert process.returncode == (-signal.SIGTERM if sigint == "ignored" else -signal.SIGINT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
