"""``file:///dir``: the embedded store, one file per entry, shared safely by processes.

Entries live under 256 fan-out directories, named by the SHA-256 of their key; each file starts
with a small header holding its key, so the directory describes itself and a new process
reopening it serves what earlier ones wrote. A value is written to a temporary name and renamed
into place, so a reader sees a whole value or none, also after ``kill -9`` mid-write (stale
temporary files are removed when a store opens). The byte budget is kept with LRU eviction by
modification time (a hit touches its file), under an exclusive lock file, so that several
processes sharing one directory evict together rather than against each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kvgroups.core.sizes import GIB
from kvgroups.errors import KVGroupsError
from kvgroups.store.base import ByteStore, EntryTooLargeError, StoreError, StoreStats, Value, check_value

logger = logging.getLogger(__name__)

STORE_FORMAT = "kvgroups.file-store/1"
MARKER = "kvgroups-store.json"
DEFAULT_MAX_BYTES = 16 * GIB
_MAGIC = b"KVGFILE1"
_KEY_LENGTH = struct.Struct("<I")
_SUFFIX = ".kve"
_TEMPORARY = ".tmp-"
# A temporary file this old belongs to a writer that died.
_STALE_SECONDS = 600
# Eviction brings the store down to this share of its budget, so it does not run on every put.
_LOW_WATERMARK = 0.9
# Other processes' writes are seen at the latest after this many of our own puts.
_RESCAN_EVERY = 256


def _write_all(descriptor: int, parts: list[bytes | bytearray | memoryview]) -> None:
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        written = os.writev(descriptor, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][written:]


def _read_exactly(descriptor: int, count: int, offset: int) -> bytes:
    data = os.pread(descriptor, count, offset)
    if len(data) == count:
        return data
    parts = [data]  # a short read (a value over 2 GiB, or a file cut short): gather the rest
    done = len(data)
    while done < count:
        more = os.pread(descriptor, count - done, offset + done)
        if not more:
            raise OSError(f"file ended {count - done} bytes early")
        parts.append(more)
        done += len(more)
    return b"".join(parts)


class FileStore(ByteStore):
    """Entries as files under ``directory``, at most ``max_bytes`` of them (files included)."""

    def __init__(self, directory: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.directory = Path(directory)
        self.url = f"file://{self.directory}?max_bytes={max_bytes}"
        self.max_bytes = max_bytes
        self._root = str(self.directory)
        self._lock = threading.Lock()
        self._claim_directory()
        self._remove_stale_temporaries()
        self._total = self._scan()[1]
        self._puts_since_scan = 0
        self._shards = {str(path) for path in self.directory.iterdir() if path.is_dir()}

    # --- layout ---------------------------------------------------------------------------
    def _claim_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
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
            temporary = self.directory / f"{_TEMPORARY}{os.getpid()}-{secrets.token_hex(4)}"
            temporary.write_text(json.dumps({"format": STORE_FORMAT}), encoding="utf-8")
            os.replace(temporary, marker)
        except (OSError, json.JSONDecodeError) as error:
            raise StoreError(f"cannot open the file store at {self.directory}: {error}") from error

    def _path(self, key: str) -> str:
        # Strings, not pathlib: this runs on every operation and pathlib costs microseconds a step.
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return f"{self._root}/{digest[:2]}/{digest[2:]}{_SUFFIX}"

    def _files(self) -> Iterator[Path]:
        for shard in self.directory.iterdir():
            if shard.is_dir() and len(shard.name) == 2:
                yield from (path for path in shard.iterdir() if path.name.endswith(_SUFFIX))

    def _remove_stale_temporaries(self) -> None:
        cutoff = time.time() - _STALE_SECONDS
        for shard in [self.directory, *(path for path in self.directory.iterdir() if path.is_dir())]:
            for path in shard.glob(f"{_TEMPORARY}*"):
                try:
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                except OSError:
                    pass  # another process removed or renamed it

    # --- values ---------------------------------------------------------------------------
    @staticmethod
    def _header(key: str) -> bytes:
        encoded = key.encode("utf-8")
        return _MAGIC + _KEY_LENGTH.pack(len(encoded)) + encoded

    def put(self, key: str, value: Value) -> None:
        value = check_value(key, value)
        header = self._header(key)
        size = len(header) + memoryview(value).nbytes
        if size > self.max_bytes:
            raise EntryTooLargeError(
                f"value of {memoryview(value).nbytes} bytes for {key!r} exceeds the file store's budget of "
                f"{self.max_bytes}"
            )
        path = self._path(key)
        shard = path[: path.rindex("/")]
        temporary = f"{shard}/{_TEMPORARY}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        try:
            if shard not in self._shards:
                os.makedirs(shard, exist_ok=True)
                self._shards.add(shard)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(descriptor, [header, value])
            finally:
                os.close(descriptor)
            os.replace(temporary, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise StoreError(f"cannot write {path}: {error}") from error
        with self._lock:
            # A replaced entry is counted twice until the next scan: keys name content, so replacing
            # one is rare, and a budget that errs early errs on the safe side.
            self._total += size
            self._puts_since_scan += 1
            due = self._total > self.max_bytes or self._puts_since_scan >= _RESCAN_EVERY
        if due:
            self._enforce_budget()

    def _read(self, key: str, limit: int | None) -> bytes | None:
        path = self._path(key)
        header = self._header(key)
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StoreError(f"cannot open {path}: {error}") from error
        try:
            size = os.fstat(descriptor).st_size - len(header)
            if size < 0 or _read_exactly(descriptor, len(header), 0) != header:
                logger.warning("file store: %s does not hold %r (corrupt header); removing it", path, key)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return None
            # One read of exactly the value's size: no buffer to grow, no copy to join.
            value = _read_exactly(descriptor, size if limit is None else min(limit, size), len(header))
        except OSError as error:
            raise StoreError(f"cannot read {path}: {error}") from error
        finally:
            os.close(descriptor)
        # Recency for LRU eviction, seen by every process; if the file was evicted meanwhile, the
        # value read is whole all the same.
        with contextlib.suppress(OSError):
            os.utime(path)
        return value

    def get(self, key: str) -> bytes | None:
        return self._read(key, None)

    def get_prefix(self, key: str, num_bytes: int) -> bytes | None:
        return self._read(key, num_bytes)

    def contains(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as error:
            raise StoreError(f"cannot delete {path}: {error}") from error
        with self._lock:
            self._total -= size
        return True

    def size_of(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size - len(self._header(key))
        except FileNotFoundError:
            return None

    def iter_keys(self) -> Iterator[str]:
        for path in self._files():
            try:
                with open(path, "rb") as file:
                    prefix = file.read(len(_MAGIC) + _KEY_LENGTH.size)
                    if prefix[:len(_MAGIC)] != _MAGIC:
                        continue
                    (length,) = _KEY_LENGTH.unpack(prefix[len(_MAGIC):])
                    yield file.read(length).decode("utf-8")
            except (OSError, UnicodeDecodeError, struct.error):
                continue  # removed meanwhile, or not ours

    # --- budget ---------------------------------------------------------------------------
    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        files = []
        for path in self._files():
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            files.append((status.st_mtime, status.st_size, path))
        return files, sum(size for _, size, _ in files)

    def _enforce_budget(self) -> None:
        """Evict least recently used files until the store is within its low watermark."""
        try:
            with open(self.directory / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                files, total = self._scan()
                if total > self.max_bytes:
                    target = int(self.max_bytes * _LOW_WATERMARK)
                    for _, size, path in sorted(files):
                        if total <= target:
                            break
                        try:
                            path.unlink()
                            total -= size
                        except FileNotFoundError:
                            total -= size
        except OSError as error:
            raise StoreError(f"cannot evict from {self.directory}: {error}") from error
        with self._lock:
            self._total = total
            self._puts_since_scan = 0

    def stats(self) -> StoreStats:
        files, total = self._scan()
        return StoreStats(entries=len(files), bytes=total)

    def clear(self) -> int:
        count = 0
        for path in list(self._files()):
            try:
                path.unlink()
                count += 1
            except FileNotFoundError:
                pass
        with self._lock:
            self._total = self._scan()[1]
        return count
