"""Loopback ports for every server the tests and benchmarks start, and starts that survive a port taken under them.

A port found free (a probe, or a bind to port 0) and closed before the server binds it can be taken in between.
Linux hands its ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default) to the
outgoing connections of every process on the machine, so a number drawn from that range is lost to any
connection opened meanwhile: vLLM's engines, Redis clients, a Redis Cluster's own links. Ports here are drawn
from outside it (for a Redis Cluster node, its bus port, ``port + 10000``, too), where only another server's
bind can take one. A start that finds its port taken anyway raises :class:`PortTakenError` after stopping what it
started, and :func:`start_on_free_ports` tries it again on other ports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLUSTER_BUS_OFFSET = 10000  # a Valkey/Redis Cluster node listens on its port and on this much above it
LOWEST_PORT = 10000  # below it, the ports services are registered for (6379, 8000, 8080, ...)
HIGHEST_PORT = 65535
DEFAULT_EPHEMERAL = (32768, 60999)
STARTS = 8
# What a server that could not bind says: Redis, and Python's errno 98 (uvicorn under vLLM, aiohttp).
ADDRESS_IN_USE = ("Address already in use", "address already in use")
_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.SystemRandom()


class PortTakenError(RuntimeError):
    """A server could not bind a port chosen for it: someone took it after it was chosen. Raised by a start
    once it has stopped whatever it had started."""


def says_port_taken(output: str) -> bool:
    """Whether a server's output says it could not bind its port."""
    return any(sign in output for sign in ADDRESS_IN_USE)


def ephemeral_range(path: Path = _LOCAL_PORT_RANGE) -> tuple[int, int]:
    """The first and last port the kernel hands to outgoing connections (both included)."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def _outside(port: int, ephemeral: tuple[int, int]) -> bool:
    return LOWEST_PORT <= port <= HIGHEST_PORT and not ephemeral[0] <= port <= ephemeral[1]


def candidate_ports(bus_offset: int | None = None, ephemeral: tuple[int, int] | None = None) -> list[int]:
    """Every port a server may be given: outside the ephemeral range, its bus port (``bus_offset`` above it)
    too. Where the range leaves none (a machine that lends every port to connections), every port from
    ``LOWEST_PORT`` up: starts then lean on their retries alone."""
    ephemeral = ephemeral or ephemeral_range()
    offsets = (0,) if bus_offset is None else (0, bus_offset)
    ports = [port for port in range(LOWEST_PORT, HIGHEST_PORT + 1)
             if all(_outside(port + offset, ephemeral) for offset in offsets)]
    if ports:
        return ports
    top = HIGHEST_PORT - max(offsets)
    return list(range(LOWEST_PORT, top + 1))


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1, *, bus_offset: int | None = None, avoid: Sequence[int] = ()) -> list[int]:
    """``count`` distinct ports outside the ephemeral range, free now (with their bus ports), drawn at random so
    that processes choosing at once rarely choose alike. Free now, not promised: start with
    :func:`start_on_free_ports`."""
    pool = candidate_ports(bus_offset)
    taken = set(avoid)
    chosen: list[int] = []
    for port in _random.sample(pool, len(pool)):
        ports = (port,) if bus_offset is None else (port, port + bus_offset)
        if taken.isdisjoint(ports) and all(_bindable(each) for each in ports):
            chosen.append(port)
            taken.update(ports)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free loopback ports outside the ephemeral range {ephemeral_range()}")


def free_port() -> int:
    """One port outside the ephemeral range, free now."""
    return free_ports(1)[0]


def start_on_free_ports(start: Callable[[list[int]], T], count: int = 1, *, bus_offset: int | None = None,
                        starts: int = STARTS, what: str = "a server") -> T:
    """``start(ports)`` on ``count`` fresh ports, again on others each time it raises :class:`PortTakenError`
    (``starts`` tries in all). ``start`` must leave nothing running when it raises."""
    tried: list[int] = []
    for attempt in range(1, starts + 1):
        ports = free_ports(count, bus_offset=bus_offset, avoid=tried)
        try:
            return start(ports)
        except PortTakenError as taken:
            tried += ports
            if attempt == starts:
                raise PortTakenError(f"{what} found its ports taken in each of {starts} starts "
                                f"(last: {taken})") from taken
            logger.warning("%s could not bind %s (%s): starting it again on other ports", what, ports, taken)
    raise AssertionError("unreachable")


def stop_process_group(process: subprocess.Popen[bytes], grace_seconds: float = 30.0) -> None:
    """SIGINT to the process group a server leads (its engine, its workers), or SIGTERM where the server ignores
    SIGINT; SIGKILL to what is left after ``grace_seconds``; returns once no process of the group runs (the
    leader reaped)."""
    # A job a non-interactive shell starts in the background (`make test &` in a script, a CI runner's step)
    # ignores SIGINT, and so does every process it starts: a server that leaves SIGINT to Python's default
    # (the P/D router, http.server) would then wait out the grace and be killed.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM if ignores_sigint(process.pid) else signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_seconds)
    with contextlib.suppress(ProcessLookupError):  # the leader gone, its children may not be
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=grace_seconds)
    # A signal is delivered when its process next runs: on a loaded machine a child the SIGKILL was sent to
    # can still be running here (a background child of a shell ignores the SIGINT).
    deadline = time.monotonic() + grace_seconds
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its ``SigIgn`` mask in /proc); False where it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    ignored = next((line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), "0")
    return bool(int(ignored, 16) >> (signal.SIGINT - 1) & 1)


@dataclass(frozen=True)
class RunningProcess:
    pid: int
    parent: int
    group: int


def running_processes() -> list[RunningProcess]:
    """Every process on the machine that has not exited (zombies left out), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # After the command's name in parentheses (which may hold spaces): state, parent, process group.
                state, parent, group = (entry / "stat").read_text().rsplit(") ", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if state != "Z":
                found.append(RunningProcess(int(entry.name), int(parent), int(group)))
    return found


def group_members(group: int) -> list[int]:
    """The processes of process group ``group`` that have not exited."""
    return [process.pid for process in running_processes() if process.group == group]


def health_answered(port: int) -> bool:
    """Whether an HTTP server on ``port`` answers ``/health`` (``vllm serve``'s readiness), not merely accepts a
    connection there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def serve_on_free_port(command: Callable[[int], list[str]], log: Path, *, ready: Callable[[int], bool],
                       seconds: float, what: str, started: Callable[[subprocess.Popen[bytes]], None] | None = None,
                       **popen: Any) -> tuple[subprocess.Popen[bytes], int]:
    """A server process (``command(port)``, in a process group of its own, output to ``log``) once
    ``ready(port)``, and its port; started again on other ports where it could not bind its own. ``started``
    is called with the process as soon as it runs. A start that fails, or is not ready within ``seconds``,
    leaves no process of its group behind."""
    def start(ports: list[int]) -> tuple[subprocess.Popen[bytes], int]:
        port = ports[0]
        with open(log, "wb") as output:
            process: subprocess.Popen[bytes] = subprocess.Popen(
                command(port), stdout=output, stderr=subprocess.STDOUT, start_new_session=True, **popen)
        deadline = time.monotonic() + seconds
        try:
            if started is not None:
                started(process)
            while process.poll() is None:
                # Ready, and still running: whoever took the port may answer a probe before the server fails.
                if ready(port) and process.poll() is None:
                    return process, port
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} was not ready within {seconds:.0f} s:\n{_tail(log)}")
                time.sleep(0.5)
            said = _tail(log)
            if says_port_taken(said):
                raise PortTakenError(f"{what} could not bind port {port}")
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{said}")
        except BaseException:
            stop_process_group(process)
            raise

    return start_on_free_ports(start, what=what)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]
