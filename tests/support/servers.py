"""Real Valkey/Redis servers and clusters for the tests and benchmarks: started on loopback ports outside the
kernel's ephemeral range (``ports``), again on others where a port was taken anyway, or on a unix socket; a
start that fails stops whatever it had started."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.ports import CLUSTER_BUS_OFFSET, PortTakenError, says_port_taken, start_on_free_ports

SERVERS = ("valkey-server", "redis-server")
# A server answers in milliseconds on an idle machine; with vLLM engines on both of a 2-core machine's cores and
# another suite's servers starting, seconds. The deadline is for a server that will never answer.
START_SECONDS = 60.0
# What Valkey and Redis log once they listen on every socket ("Ready to accept connections tcp", "The server is
# now ready to accept connections at /path/server.sock"), lowercased.
READY = "ready to accept connections"


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


def certificates(directory: Path) -> dict[str, Path]:
    """A throwaway CA, and a server and a client certificate it signed (for 127.0.0.1), made by openssl."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*arguments: str) -> None:
        subprocess.run(["openssl", *arguments], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=kvgroups-test-ca")
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "1", "-extfile", "ext.cnf")
    return {name: directory / name for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


class Server:
    """One server process; ``url`` is a redis://, rediss:// or unix:// URL for kvgroups' open_store.

    ``password`` makes the server require it; ``tls`` (certificates from :func:`certificates`)
    serves TLS only, clients presenting a certificate of the same CA.
    """

    def __init__(self, directory: Path, *, unix: bool = False, settings: tuple[str, ...] = (),
                 port: int | None = None, password: str | None = None,
                 tls: dict[str, Path] | None = None) -> None:
        self.directory = directory
        self.settings = settings
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "server.log"
        self.socket = directory / "server.sock" if unix else None
        self.password = password
        self.tls = tls
        self.port = 0
        if unix:
            self._start(0)
        elif port is not None:  # a server started again where its clients (or its cluster) know it
            self._start(port)
        else:
            start_on_free_ports(lambda ports: self._start(ports[0]), what="a Valkey/Redis server")

    def _start(self, port: int) -> None:
        """The server on ``port``, answering; on failure nothing is left running (PortTakenError where the
        port was taken)."""
        self.port = port
        tls = self.tls
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls["server.crt"]),
                  "--tls-key-file", str(tls["server.key"]), "--tls-ca-cert-file", str(tls["ca.crt"]),
                  "--tls-auth-clients", "yes"] if tls else ["--port", str(port)]
        arguments = [server_binary(), *listen, "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.directory), "--daemonize", "no", *self.settings]
        if self.password is not None:
            arguments += ["--requirepass", self.password]
        if self.socket is not None:
            arguments += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(arguments, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password is not None else ""
        if self.socket is not None:
            return f"unix://{credentials}{self.socket}"
        if self.tls is not None:
            return (f"rediss://{credentials}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca.crt']}"
                    f"&ssl_certfile={self.tls['client.crt']}&ssl_keyfile={self.tls['client.key']}")
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def _wait_ready(self) -> None:
        """Until the server says it accepts connections: every listening socket bound (a cluster's bus too).
        Not a connection to the port, which whoever took the port would accept as well."""
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            said = self.log.read_text(errors="replace")
            if self.process.poll() is not None:
                failure = PortTakenError if says_port_taken(said) else RuntimeError
                raise failure(f"the server on port {self.port} exited at start with code "
                              f"{self.process.returncode}: {said[-2000:]}")
            if READY in said.lower():
                return
            time.sleep(0.02)
        raise RuntimeError(f"the server did not start within {START_SECONDS:.0f} s: "
                           f"{self.log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@contextmanager
def running_server(directory: Path, **options: object) -> Iterator[Server]:
    server = Server(directory, **options)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


class Cluster:
    """A Valkey/Redis Cluster on loopback: ``masters`` masters with ``replicas`` replicas each, slots
    spread by ``redis-cli --cluster create``, up once every node says ``cluster_state:ok`` and every
    master has its replicas. ``url`` is a ``redis-cluster://`` URL of the first two nodes."""

    def __init__(self, directory: Path, *, masters: int = 3, replicas: int = 1,
                 settings: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.num_masters = masters
        self.nodes: dict[int, Server] = {}
        self.ports: list[int] = []
        start_on_free_ports(lambda ports: self._start_nodes(ports, settings), masters * (1 + replicas),
                            bus_offset=CLUSTER_BUS_OFFSET, what="a cluster")
        try:
            subprocess.run([self.cli(), "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                            "--cluster-replicas", str(replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=120)
            self.wait_until_ok(masters, replicas, timeout=120)
        except BaseException:
            self.stop()
            raise

    def _start_nodes(self, ports: list[int], settings: tuple[str, ...]) -> None:
        """A node on each port (and its bus port, 10000 above); where one cannot start, none is left running."""
        self.ports = ports
        try:
            for port in ports:
                self.nodes[port] = Server(self.directory / str(port), port=port, settings=(
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
                    "1000", "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0",
                    *settings))
        except BaseException:
            self.stop()
            self.nodes = {}
            raise

    @staticmethod
    def cli() -> str:
        found = shutil.which("valkey-cli") or shutil.which("redis-cli")
        if found is None:
            raise RuntimeError("a cluster needs redis-cli (or valkey-cli): apt-get install redis-tools")
        return found

    def ask(self, port: int, *command: str) -> str:
        """A node's answer; "" from a node that does not answer within 10 s (stopped)."""
        try:
            return subprocess.run([self.cli(), "-p", str(port), *command], capture_output=True, text=True,
                                  timeout=10, check=False).stdout
        except subprocess.TimeoutExpired:
            return ""

    def in_sync(self, port: int, timeout: float = 120.0) -> None:
        """Until master ``port``'s replica holds everything it wrote (``WAIT 1`` answers 1). A replica
        that has just joined (a fresh cluster, a node started again) copies its master only after the
        servers' diskless-sync delay (5 s): ``WAIT`` meanwhile answers 0, and a master killed before
        then hands its slots to a replica holding nothing."""
        deadline = time.monotonic() + timeout
        while self.ask(port, "wait", "1", "5000").strip() != "1":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica of {port} did not catch up within {timeout:.0f} s")

    def masters(self) -> list[int]:
        """Ports of the masters that are up, as the first live node that answers sees the cluster (a replica
        loading its master's data answers LOADING to everything, a stopped one nothing: the next is asked)."""
        for port, node in self.nodes.items():
            if node.process.poll() is not None:
                continue
            answer = self.ask(port, "cluster", "nodes")
            if "myself" not in answer:
                continue
            found = []
            for line in answer.splitlines():
                fields = line.split()
                if len(fields) > 2 and "master" in fields[2] and "fail" not in fields[2]:
                    found.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
            return sorted(found)
        return []

    def wait_until_ok(self, masters: int, replicas: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [port for port, node in self.nodes.items() if node.process.poll() is None]
            states = [self.ask(port, "cluster", "info") for port in live]
            if all("cluster_state:ok" in state for state in states) and len(self.masters()) == masters:
                linked = [self.ask(port, "info", "replication") for port in self.masters()]
                if all(f"connected_slaves:{replicas}" in info for info in linked) or replicas == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the cluster did not come up within {timeout} s")

    def wait_for_masters(self, masters: int, timeout: float = 30) -> None:
        """Until ``masters`` masters are up and every slot is served again (after a failover)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [port for port, node in self.nodes.items() if node.process.poll() is None]
            if len(self.masters()) == masters and all(
                    "cluster_state:ok" in self.ask(port, "cluster", "info") for port in live):
                return
            time.sleep(0.2)
        raise RuntimeError(f"no failover within {timeout} s")

    @property
    def url(self) -> str:
        return f"redis-cluster://127.0.0.1:{self.ports[0]},127.0.0.1:{self.ports[1]}/"

    def kill(self, port: int) -> None:
        self.nodes[port].stop()

    def restart(self, port: int, timeout: float = 120) -> None:
        """Start the killed node ``port`` again (it rejoins as a replica: its data is the new master's once it
        has copied it, after the servers' diskless-sync delay) and wait until the cluster is whole."""
        old = self.nodes[port]
        self.nodes[port] = Server(old.directory, port=port, settings=old.settings)
        # Not len(self.masters()): a node started again says it is still the master it was for a moment.
        self.wait_until_ok(self.num_masters, 1, timeout=timeout)

    def master_of(self, replica: int) -> int:
        """The port of the master replica ``replica`` copies."""
        info = self.ask(replica, "info", "replication")
        return int(next(line.split(":")[1] for line in info.splitlines() if line.startswith("master_port:")))

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@contextmanager
def running_cluster(directory: Path, **options: object) -> Iterator[Cluster]:
    cluster = Cluster(directory, **options)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()
