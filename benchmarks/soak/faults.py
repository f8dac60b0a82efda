"""The faults the soak injects (``benchmarks.soak.run``), each with its undoing, on the real parts it runs.

Every fault is a :class:`Fault`: ``inject`` at its start, ``undo`` at its end (a fault that happens
at once, such as a corruption, has nothing to undo). What each one does to which part is in its
``what``; the soak's table prints it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.servers import Cluster


@dataclass
class Fault:
    """One fault: its name, what it does, how to start and end it."""

    name: str
    what: str
    inject: Callable[[], None]
    undo: Callable[[], None] = lambda: None


def mount_tmpfs(directory: Path, size_mib: int) -> None:
    """A small tmpfs at ``directory`` (the soak runs as root), so that a file tier can be filled."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(directory)],
                   check=True, capture_output=True)


def unmount(directory: Path) -> None:
    subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True)


def remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True, capture_output=True)


def entry_files(store_dir: Path) -> list[Path]:
    found = []
    for folder, _, names in os.walk(store_dir):  # rglob fails on a folder removed while it walks
        found += [Path(folder) / name for name in names if not name.startswith(".")]
    return found


class Faults:
    """The faults of one soak: its cluster, the servers' file tiers (tmpfs mounts), a way to kill and
    start a server again."""

    def __init__(self, cluster: Cluster, tiers: dict[str, Path], restart: Callable[[str], None],
                 kill: Callable[[str], None], seed: int = 0) -> None:
        self.cluster = cluster
        self.tiers = tiers  # server name -> its tmpfs mount (the file tier lives in mount/kv)
        self.restart_server, self.kill_server = restart, kill
        self.random = random.Random(seed)
        self._killed: int | None = None
        self._stopped: int | None = None
        self._memory: dict[int, tuple[str, str]] = {}

    def all(self) -> list[Fault]:
        first, second = sorted(self.tiers)
        return [
            Fault("master killed", "a cluster master SIGKILLed (its replica takes over), then started again",
                  self._kill_master, self._start_master),
            Fault("node stopped", "a cluster master SIGSTOPped for longer than the store's 2 s timeout, then resumed",
                  self._stop_node, self._resume_node),
            Fault("cluster full", "every master's maxmemory set to what it holds, eviction off: writes refused (OOM)",
                  self._fill_cluster, self._unfill_cluster),
            Fault("file tier full", f"{first}'s file tier's filesystem filled by another writer",
                  lambda: self._fill_tier(first), lambda: self._unfill_tier(first)),
            Fault("entries corrupted", f"bytes flipped in 20 of {second}'s files and 20 cluster values",
                  lambda: self._corrupt(second)),
            Fault("entries deleted", f"20 of {first}'s files and 20 cluster values deleted behind the store's back",
                  lambda: self._delete(first)),
            Fault("store unwritable", f"{second}'s file tier's filesystem remounted read-only, then read-write",
                  lambda: remount(self.tiers[second], "ro"), lambda: remount(self.tiers[second], "rw")),
            Fault("server killed", f"{second}'s vllm serve SIGKILLed mid-run (process group), then started again",
                  lambda: self.kill_server(second), lambda: self.restart_server(second)),
        ]

    # --- the cluster --------------------------------------------------------------------------
    def _kill_master(self) -> None:
        self._killed = self.random.choice(self.cluster.masters())
        self.cluster.kill(self._killed)

    def _start_master(self) -> None:
        port, self._killed = self._killed, None
        if port is None:
            return
        self.cluster.restart(port)  # rejoins as a replica

    def _stop_node(self) -> None:
        self._stopped = self.random.choice(self.cluster.masters())
        os.kill(self.cluster.nodes[self._stopped].process.pid, signal.SIGSTOP)

    def _resume_node(self) -> None:
        port, self._stopped = self._stopped, None
        if port is not None:
            os.kill(self.cluster.nodes[port].process.pid, signal.SIGCONT)
            self.cluster.wait_until_ok(3, 1, timeout=120)

    def _fill_cluster(self) -> None:
        for port in self.cluster.masters():
            info = self.cluster.ask(port, "info", "memory")
            used = next(int(line.split(":")[1]) for line in info.splitlines() if line.startswith("used_memory:"))
            before = (self.cluster.ask(port, "config", "get", "maxmemory").split()[-1],
                      self.cluster.ask(port, "config", "get", "maxmemory-policy").split()[-1])
            self._memory[port] = before
            self.cluster.ask(port, "config", "set", "maxmemory-policy", "noeviction")
            self.cluster.ask(port, "config", "set", "maxmemory", str(used))

    def _unfill_cluster(self) -> None:
        for port, (maxmemory, policy) in self._memory.items():
            with contextlib.suppress(Exception):
                self.cluster.ask(port, "config", "set", "maxmemory", maxmemory)
                self.cluster.ask(port, "config", "set", "maxmemory-policy", policy)
        self._memory.clear()

    def _cluster_keys(self, count: int) -> list[tuple[int, str]]:
        """Up to ``count`` value keys of kvgroups' (heads and parts), with the master holding each."""
        found: list[tuple[int, str]] = []
        for port in self.cluster.masters():
            out = self.cluster.ask(port, "--scan", "--pattern", "kvgroups:*", "--count", "1000")
            found += [(port, key) for key in out.split()[:count]]
        self.random.shuffle(found)
        return found[:count]

    # --- a file tier --------------------------------------------------------------------------
    def _fill_tier(self, server: str) -> None:
        filler = self.tiers[server] / "filler"
        block = b"\0" * (1 << 20)
        # ENOSPC is the point, and it can come already at the file's creation (it did in CI)
        with contextlib.suppress(OSError), open(filler, "wb") as sink:
            while True:
                sink.write(block)
                sink.flush()

    def _unfill_tier(self, server: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.tiers[server] / "filler").unlink()

    def _corrupt(self, server: str) -> None:
        files = entry_files(self.tiers[server] / "kv")
        for path in self.random.sample(files, min(20, len(files))):
            with contextlib.suppress(OSError):
                data = bytearray(path.read_bytes())
                if data:
                    data[self.random.randrange(len(data))] ^= 0x20
                    path.write_bytes(bytes(data))
        for port, key in self._cluster_keys(20):
            length = self.cluster.ask(port, "strlen", key).strip()
            if length.isdigit() and int(length) > 0:
                offset = self.random.randrange(int(length))
                self.cluster.ask(port, "setrange", key, str(offset), self.random.choice("abcdefgh"))

    def _delete(self, server: str) -> None:
        files = entry_files(self.tiers[server] / "kv")
        for path in self.random.sample(files, min(20, len(files))):
            with contextlib.suppress(OSError):
                path.unlink()
        for port, key in self._cluster_keys(20):
            self.cluster.ask(port, "del", key)

    def cleanup(self) -> None:
        """Undo whatever a fault still holds (a run that stopped in the middle of one)."""
        self._unfill_cluster()
        if self._stopped is not None:
            self._resume_node()
        for server, mount in self.tiers.items():
            with contextlib.suppress(Exception):
                remount(mount, "rw")
            self._unfill_tier(server)


def directory_bytes(directory: Path) -> int:
    """The bytes of the entries under ``directory``, as the store changes them (an entry evicted while
    counted is not counted)."""
    total = 0
    for path in entry_files(directory) if directory.exists() else []:
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue += children.get(current, [])
    return found


def file_kind(target: str, shard_root: str) -> str:
    """What an open file descriptor is, from its ``/proc/PID/fd`` link: ``shard directory`` (one of
    the file store's 256 fan-out directories under ``shard_root``, which it keeps open), ``socket``,
    ``pipe``, ``anon`` (eventfd, epoll, ...), ``shm`` (shared memory), ``dev``, or ``file``."""
    if target.startswith(("socket:", "pipe:")):
        return target.split(":", 1)[0]
    if target.startswith("anon_inode:"):
        return "anon"
    if target.startswith(("/dev/shm/", "/memfd:")):
        return "shm"
    folder, _, name = target.rpartition("/")
    if folder == shard_root and len(name) == 2:
        return "shard directory"
    return "dev" if target.startswith("/dev/") else "file"


def resources(pid: int, shard_root: Path) -> dict[str, Any]:
    """Resident memory (bytes), threads and open files of a process and its children, summed; the
    open files also by :func:`file_kind`, so that a run whose files grow says which grew. The file
    store's shard directories are counted apart (``shard_directories``, and the most one process
    holds): a cache that fills as a store first touches each one, bounded, not a leak."""
    rss = threads = files = shards = most_shards = 0
    root = os.path.realpath(shard_root)
    kinds: dict[str, int] = {}
    for each in process_tree(pid):
        with contextlib.suppress(OSError, ValueError, StopIteration):
            status = Path(f"/proc/{each}/status").read_text().splitlines()
            rss += int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024
            threads += int(next(line for line in status if line.startswith("Threads:")).split()[1])
            held = 0
            for fd in os.listdir(f"/proc/{each}/fd"):
                with contextlib.suppress(OSError):
                    kind = file_kind(os.readlink(f"/proc/{each}/fd/{fd}"), root)
                    if kind == "shard directory":
                        held += 1
                        continue
                    kinds[kind] = kinds.get(kind, 0) + 1
                    files += 1
            shards += held
            most_shards = max(most_shards, held)
    return {"rss": rss, "threads": threads, "files": files, "file_kinds": kinds, "shard_directories": shards,
            "most_shard_directories": most_shards, "time": time.monotonic()}
