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
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "server.log"
        self.port = 0 if unix else port or free_port()
        self.socket = directory / "server.sock" if unix else None
        self.password = password
        self.tls = tls
        listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls["server.crt"]),
                  "--tls-key-file", str(tls["server.key"]), "--tls-ca-cert-file", str(tls["ca.crt"]),
                  "--tls-auth-clients", "yes"] if tls else ["--port", str(self.port)]
        arguments = [server_binary(), *listen, "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(directory), "--daemonize", "no", *settings]
        if password is not None:
            arguments += ["--requirepass", password]
        if self.socket is not None:
            arguments += ["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(arguments, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

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
