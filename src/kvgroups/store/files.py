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

from kvgroups.errors import KVGroupsError
from kvgroups.sizes import GIB
from kvgroups.store.base import ByteStore, EntryTooLargeError, StoreError, StoreStats, check_value

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


class FileStore(ByteStore):
    """Entries as files under ``directory``, at most ``max_bytes`` of them (files included)."""

    def __init__(self, directory: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.directory = Path(directory)
        self.url = f"file://{self.directory}?max_bytes={max_bytes}"
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._claim_directory()
        self._remove_stale_temporaries()
        self._total = self._scan()[1]
        self._puts_since_scan = 0

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

    def _path(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self.directory / digest[:2] / (digest[2:] + _SUFFIX)

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

    def put(self, key: str, value: bytes) -> None:
        value = check_value(key, value)
        header = self._header(key)
        size = len(header) + len(value)
        if size > self.max_bytes:
            raise EntryTooLargeError(
                f"value of {len(value)} bytes for {key!r} exceeds the file store's budget of {self.max_bytes}"
            )
        path = self._path(key)
        temporary = path.parent / f"{_TEMPORARY}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(value)
            try:
                replaced = path.stat().st_size
            except FileNotFoundError:
                replaced = 0
            os.replace(temporary, path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise StoreError(f"cannot write {path}: {error}") from error
        with self._lock:
            self._total += size - replaced
            self._puts_since_scan += 1
            due = self._total > self.max_bytes or self._puts_since_scan >= _RESCAN_EVERY
        if due:
            self._enforce_budget()

    def _read(self, key: str, limit: int | None) -> bytes | None:
        path = self._path(key)
        header = self._header(key)
        try:
            with open(path, "rb") as file:
                found = file.read(len(header))
                if found != header:
                    logger.warning("file store: %s does not hold %r (corrupt header); removing it", path, key)
                    path.unlink(missing_ok=True)
                    return None
                # read(n) allocates n bytes up front: never ask for more than the file holds.
                value = file.read() if limit is None else file.read(min(limit, os.fstat(file.fileno()).st_size))
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StoreError(f"cannot read {path}: {error}") from error
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
        return self._path(key).exists()

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as error:
            raise StoreError(f"cannot delete {path}: {error}") from error
        with self._lock:
            self._total -= size
        return True

    def size_of(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size - len(self._header(key))
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
