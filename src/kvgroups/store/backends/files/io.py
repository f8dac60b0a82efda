"""What the file store needs of the operating system beyond one call: whole reads and writes on
descriptors, a private store directory, and a budget the filesystem can hold."""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.base import StoreError, Value

# An entry file's key is stored after the format's magic, behind its length.
KEY_LENGTH = struct.Struct("<I")
# How the store opens every file: never through a link, never inherited by a child process.
NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# The default budget leaves this share of the filesystem (what is free plus what the store holds) alone.
_FILESYSTEM_SHARE = 0.9


def write_all(descriptor: int, parts: list[Value]) -> None:
    """Write every part in order (``writev``, resumed after a short write)."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        written = os.writev(descriptor, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][written:]


def read_exactly(descriptor: int, count: int, offset: int, into: memoryview | None = None) -> bytes | memoryview:
    """``count`` bytes at ``offset`` (with ``into``: at most its size, read into it, and a view of what was
    read); raises OSError when the file ends first."""
    if into is not None:
        target = into[:min(count, into.nbytes)]
        done = 0
        while done < target.nbytes:
            read = os.preadv(descriptor, [target[done:]], offset + done)
            if not read:
                raise OSError(f"file ended {target.nbytes - done} bytes early")
            done += read
        return target
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


def private_directory(path: Path, create: bool) -> None:
    """``path`` as a directory only this user can use: created 0700, refused when another user owns
    it or others may write to it, tightened to 0700 when others may read it."""
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=True)
    try:
        status = path.stat()
    except FileNotFoundError:
        raise StoreError(f"cannot open the file store at {path}: there is no store there") from None
    except OSError as error:
        raise StoreError(f"cannot open the file store at {path}: {error.strerror}") from None
    if not stat.S_ISDIR(status.st_mode):
        raise StoreError(f"cannot open the file store at {path}: not a directory")
    if status.st_uid != os.geteuid():
        raise KVGroupsError(f"{path} is owned by user {status.st_uid}, not by this process's user "
                            f"{os.geteuid()}; a store directory must be private to the user that serves from it")
    if status.st_mode & 0o022:
        raise KVGroupsError(f"{path} is writable by other users (mode {stat.S_IMODE(status.st_mode):o}); anyone "
                            f"could plant entries there: use a directory of mode 0700")
    if status.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours and not writable by others: only readable, so make it private


def default_budget(directory: Path, held: int, largest: int) -> int:
    """``largest``, or less where the filesystem cannot hold that beside what else is on it (what is
    free plus the ``held`` bytes the store already has, less a tenth for everything else)."""
    usage = os.statvfs(directory)
    return min(largest, int((usage.f_bavail * usage.f_frsize + held) * _FILESYSTEM_SHARE))


def _shards(root: str) -> Iterator[str]:
    """The fan-out directories under ``root`` (two-letter names; symlinks are not followed)."""
    with os.scandir(root) as entries:
        for entry in entries:
            if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False):
                yield entry.name


def entry_files(root: str, suffix: str) -> Iterator[os.DirEntry[str]]:
    """Every regular file named ``*suffix`` in a shard of ``root``."""
    for shard in list(_shards(root)):
        with contextlib.suppress(FileNotFoundError), os.scandir(f"{root}/{shard}") as entries:
            for entry in entries:
                if entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False):
                    yield entry


def scan_entries(root: str, suffix: str) -> tuple[list[tuple[float, int, str]], int]:
    """``(modified, size, path)`` of every entry file, and their total size."""
    files = []
    for entry in entry_files(root, suffix):
        with contextlib.suppress(FileNotFoundError):
            status = entry.stat(follow_symlinks=False)
            files.append((status.st_mtime, status.st_size, entry.path))
    return files, sum(size for _, size, _ in files)


def remove_stale_temporaries(root: str, prefix: str, stale_seconds: float) -> None:
    """Remove temporary files (``prefix*``) older than ``stale_seconds``: their writers died."""
    cutoff = time.time() - stale_seconds
    for directory in [root, *(f"{root}/{shard}" for shard in _shards(root))]:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith(prefix):
                    with contextlib.suppress(OSError):  # another process removed or renamed it
                        if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                            os.unlink(entry.path)


def stored_key(path: str, magic: bytes) -> str | None:
    """The key an entry file holds (it starts with ``magic``, the key's length, the key); None when the
    file is gone or is not an entry."""
    prefix_bytes = len(magic) + KEY_LENGTH.size
    try:
        descriptor = os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError:
        return None  # removed meanwhile
    try:
        prefix = os.pread(descriptor, prefix_bytes, 0)
        if prefix[:len(magic)] != magic or len(prefix) != prefix_bytes:
            return None  # not ours
        (length,) = KEY_LENGTH.unpack(prefix[len(magic):])
        return os.pread(descriptor, min(length, 4096), prefix_bytes).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(descriptor)


def evict_least_recent(files: list[tuple[float, int, str]], total: int, target: int,
                       key_of: Callable[[str], str | None] | None = None) -> tuple[int, int, list[str]]:
    """Remove entry files (``(recency, bytes, path)`` as :func:`scan_entries` lists them), least recently
    used first, until ``total`` bytes are at most ``target``: (bytes left, files removed, and with
    ``key_of`` the keys they held, read before each is removed)."""
    removed, keys = 0, []
    for _, size, path in sorted(files):
        if total <= target:
            break
        key = key_of(path) if key_of is not None else None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
            if key is not None:
                keys.append(key)
        total -= size
    return total, removed, keys
