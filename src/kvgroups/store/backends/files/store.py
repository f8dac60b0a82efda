"""``file:///dir``: the embedded store, one private file per entry, shared safely by processes.

Entries live under 256 fan-out directories, named by the SHA-256 of their key; each file starts
with its key, so a new process serves what earlier ones wrote. A value is written to a temporary
name and renamed into place (whole or absent, also after ``kill -9``). Files are 0600, directories
0700 whatever the umask; nothing in the store is reached through a symlink. The byte budget is kept
by LRU eviction under a lock file all processes share; a full disk makes a write evict, then retry.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

from kvgroups.core.sizes import GIB
from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.base import (
    ByteStore,
    EntryTooLargeError,
    Stored,
    StoreError,
    StoreFullError,
    StoreStats,
    Value,
    check_value,
)
from kvgroups.store.backends.files.io import (
    KEY_LENGTH,
    NOFOLLOW,
    default_budget,
    entry_files,
    evict_least_recent,
    private_directory,
    read_exactly,
    remove_stale_temporaries,
    scan_entries,
    stored_key,
    write_all,
)
from kvgroups.store.backends.files.shards import ShardDirectories

logger = logging.getLogger(__name__)

STORE_FORMAT = "kvgroups.file-store/1"
MARKER = "kvgroups-store.json"
DEFAULT_MAX_BYTES = 16 * GIB
_MAGIC = b"KVGFILE1"
_SUFFIX = ".kve"
_TEMPORARY = ".tmp-"
# A temporary file this old belongs to a writer that died.
_STALE_SECONDS = 600
# Eviction brings the store down to this share of its budget, so it does not run on every put.
_LOW_WATERMARK = 0.9
# Other processes' writes are seen at the latest after this many of our own puts.
_RESCAN_EVERY = 256
_FULL = (errno.ENOSPC, errno.EDQUOT)


class FileStore(ByteStore):
    """Entries as files under ``directory``, at most ``max_bytes`` of them (files included).

    ``max_bytes`` None is :func:`default_budget`. ``create`` False opens only a store that exists
    (inspection: stats, verify, clear never create one). ``get_into`` reads straight into the buffer.
    """

    tier_name = "file"

    def __init__(self, directory: str | Path, max_bytes: int | None = None, *, create: bool = True) -> None:
        self.directory = Path(directory)
        self._root = str(self.directory)
        self._lock = threading.Lock()
        self._shards = ShardDirectories(self._root)
        self._claim_directory(create)
        remove_stale_temporaries(self._root, _TEMPORARY, _STALE_SECONDS)
        held = self._scan()[1]
        self.max_bytes = default_budget(self.directory, held, DEFAULT_MAX_BYTES) if max_bytes is None else max_bytes
        self.url = f"file://{self.directory}?max_bytes={self.max_bytes}"
        self._total = held
        self._puts_since_scan = 0
        self.evictions = 0

    # --- layout ---------------------------------------------------------------------------
    def _claim_directory(self, create: bool) -> None:
        private_directory(self.directory, create)
        try:
            marker = self.directory / MARKER
            if marker.exists():
                described = json.loads(marker.read_text(encoding="utf-8"))
                if not isinstance(described, dict) or described.get("format") != STORE_FORMAT:
                    raise KVGroupsError(f"{self.directory} holds a store of format {described!r}; "
                                        f"expected {STORE_FORMAT!r}")
                return
            others = [entry.name for entry in self.directory.iterdir() if not entry.name.startswith(".")]
            if others:
                raise KVGroupsError(
                    f"{self.directory} is not empty and not a kvgroups store (it holds {sorted(others)[:3]}); "
                    f"use an empty directory or one kvgroups created"
                )
            temporary = f"{_TEMPORARY}{os.getpid()}-{secrets.token_hex(4)}"
            descriptor = os.open(self.directory / temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
            try:
                write_all(descriptor, [json.dumps({"format": STORE_FORMAT}).encode("utf-8")])
            finally:
                os.close(descriptor)
            os.replace(self.directory / temporary, marker)
        except (OSError, json.JSONDecodeError) as error:
            raise StoreError(f"cannot open the file store at {self.directory}: {error}") from error

    @staticmethod
    def _names(key: str) -> tuple[str, str]:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return digest[:2], f"{digest[2:]}{_SUFFIX}"

    def _path(self, key: str) -> str:
        return "/".join((self._root, *self._names(key)))

    # --- values ---------------------------------------------------------------------------
    @staticmethod
    def _header(key: str) -> bytes:
        encoded = key.encode("utf-8")
        return _MAGIC + KEY_LENGTH.pack(len(encoded)) + encoded

    def put(self, key: str, value: Value) -> None:
        value = check_value(key, value)
        header = self._header(key)
        size = len(header) + memoryview(value).nbytes
        if size > self.max_bytes:
            raise EntryTooLargeError(
                f"value of {memoryview(value).nbytes} bytes for {key!r} exceeds the file store's budget of "
                f"{self.max_bytes}"
            )
        try:
            self._write(key, header, value)
        except OSError as error:
            if error.errno not in _FULL:
                raise StoreError(f"cannot write {self._path(key)}: {error}") from error
            # The disk filled (other files, other processes): evict down to the low watermark, once.
            self._enforce_budget(force=True)
            try:
                self._write(key, header, value)
            except OSError as again:
                kind = StoreFullError if again.errno in _FULL else StoreError
                raise kind(f"cannot write {self._path(key)} after evicting: {again}") from again
        with self._lock:
            # A replaced entry is counted twice until the next scan: keys name content, so replacing
            # one is rare, and a budget that errs early errs on the safe side.
            self._total += size
            self._puts_since_scan += 1
            due = self._total > self.max_bytes or self._puts_since_scan >= _RESCAN_EVERY
        if due:
            self._enforce_budget()

    def _write(self, key: str, header: bytes, value: Value) -> None:
        shard, name = self._names(key)
        for directory in self._shards.attempts(shard, create=True):
            temporary = f"{_TEMPORARY}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
            try:
                descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600,
                                     dir_fd=directory)
                try:
                    os.fchmod(descriptor, 0o600)  # whatever the umask
                    write_all(descriptor, [header, value])
                finally:
                    os.close(descriptor)
                os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
                return
            except OSError as error:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=directory)
                if not isinstance(error, FileNotFoundError):  # that one: the directory may have gone, try again
                    raise
        raise StoreError(f"{self._root}/{shard} vanished while writing")

    def _read(self, key: str, limit: int | None, into: memoryview | None = None) -> Stored | None:
        shard, name = self._names(key)
        header = self._header(key)
        for directory in self._shards.attempts(shard, create=False):
            try:
                descriptor = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=directory)
                break
            except FileNotFoundError:
                continue
            except OSError as error:
                if error.errno != errno.ELOOP:
                    raise StoreError(f"cannot open {self._path(key)}: {error}") from error
                logger.warning("file store %s: an entry is a symlink; removing it, not following it", self.directory)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=directory)
                return None
        else:
            return None
        try:
            size = os.fstat(descriptor).st_size - len(header)
            if size < 0 or read_exactly(descriptor, len(header), 0) != header:
                logger.warning("file store %s: an entry file does not hold its key (corrupt header); removing it",
                               self.directory)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=directory)
                return None
            # One read of at most the value's size (into ``into`` when given): no buffer to grow, no copy to join.
            value = read_exactly(descriptor, size if limit is None else min(limit, size), len(header), into)
        except OSError as error:
            raise StoreError(f"cannot read {self._path(key)}: {error}") from error
        finally:
            os.close(descriptor)
        # Recency for LRU eviction, seen by every process (a file evicted meanwhile was read whole all the same).
        with contextlib.suppress(OSError):
            os.utime(name, dir_fd=directory, follow_symlinks=False)
        return value

    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        return self._read(key, None if max_bytes is None else max_bytes + 1)

    def get_prefix(self, key: str, num_bytes: int) -> Stored | None:
        return self._read(key, num_bytes)

    def get_many_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[Stored | None]:
        return [self.get_into(key, buffer) for key, buffer in zip(keys, buffers, strict=True)]  # each read in place

    def get_into(self, key: str, buffer: memoryview) -> Stored | None:
        return self._read(key, buffer.nbytes, buffer)

    def contains(self, key: str) -> bool:
        shard, name = self._names(key)
        for directory in self._shards.attempts(shard, create=False):
            try:
                return stat.S_ISREG(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                continue
            except OSError as error:
                raise StoreError(f"cannot look up {self._path(key)}: {error}") from error
        return False

    def delete(self, key: str) -> bool:
        shard, name = self._names(key)
        for directory in self._shards.attempts(shard, create=False):
            try:
                size = os.stat(name, dir_fd=directory, follow_symlinks=False).st_size
                os.unlink(name, dir_fd=directory)
            except FileNotFoundError:
                continue
            except OSError as error:
                raise StoreError(f"cannot delete {self._path(key)}: {error}") from error
            with self._lock:
                self._total -= size
            return True
        return False

    def size_of(self, key: str) -> int | None:
        shard, name = self._names(key)
        for directory in self._shards.attempts(shard, create=False):
            try:
                return os.stat(name, dir_fd=directory, follow_symlinks=False).st_size - len(self._header(key))
            except FileNotFoundError:
                continue
        return None

    def iter_keys(self) -> Iterator[str]:
        for entry in entry_files(self._root, _SUFFIX):
            key = stored_key(entry.path, _MAGIC)
            if key is not None:
                yield key

    # --- budget ---------------------------------------------------------------------------
    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        return scan_entries(self._root, _SUFFIX)

    def _enforce_budget(self, *, force: bool = False) -> None:
        """Evict least recently used files down to the low watermark: when over the budget, or
        (``force``, on a full disk) from whatever the store holds now."""
        try:
            descriptor = os.open(self.directory / ".lock", os.O_WRONLY | os.O_CREAT | NOFOLLOW, 0o600)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
                files, total = self._scan()
                target = int((total if force else self.max_bytes) * _LOW_WATERMARK)
                listener, evicted_keys = self.eviction_listener, list[str]()
                if force or total > self.max_bytes:
                    key_of = None if listener is None else partial(stored_key, magic=_MAGIC)
                    total, evicted, evicted_keys = evict_least_recent(files, total, target, key_of)
                    self.evictions += evicted
            finally:
                os.close(descriptor)
        except OSError as error:
            raise StoreError(f"cannot evict from {self.directory}: {error}") from error
        with self._lock:
            self._total = total
            self._puts_since_scan = 0
        if evicted_keys and listener is not None:
            listener(evicted_keys)

    def gauges(self) -> dict[str, float]:  # no entries: counting them lists the directory
        return {"bytes": float(self._total), "evictions": float(self.evictions)}

    def stats(self) -> StoreStats:
        files, total = self._scan()
        return StoreStats(entries=len(files), bytes=total)

    def clear(self) -> int:
        count = 0
        for entry in list(entry_files(self._root, _SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                count += 1
        with self._lock:
            self._total = self._scan()[1]
        return count

    def close(self) -> None:
        self._shards.close()
