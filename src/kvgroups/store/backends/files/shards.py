"""The file store's fan-out directories, each opened once (never through a symlink) and kept open, so
that every entry is reached by a name relative to a descriptor; one removed behind the store's back
is opened again where it was made again."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from kvgroups.store.backends.base import StoreError
from kvgroups.store.backends.files.io import NOFOLLOW


class ShardDirectories:
    """The descriptors of the shard directories under ``root`` (at most one a shard: 256 a store)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._descriptors: dict[str, int] = {}

    def _open(self, shard: str, create: bool) -> int | None:
        """A new descriptor of directory ``shard``; None when absent."""
        path = f"{self.root}/{shard}"
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as error:  # ELOOP, ENOTDIR: a symlink or a file where a shard should be
            raise StoreError(f"{path} is not a shard directory of this store ({error.strerror}); not followed") \
                from error

    def _kept(self, shard: str, create: bool) -> int | None:
        descriptor = self._descriptors.get(shard)
        if descriptor is not None:
            return descriptor
        descriptor = self._open(shard, create)
        if descriptor is None:
            return None
        with self._lock:
            kept = self._descriptors.setdefault(shard, descriptor)
        if kept != descriptor:  # another thread opened it first
            os.close(descriptor)
        return kept

    def attempts(self, shard: str, create: bool) -> Iterator[int]:
        """The descriptor of directory ``shard`` (made when ``create``; none when absent); once more,
        pointing at the directory made again, when the caller found nothing because the one it had
        was removed behind the store's back (an operator's ``rm -rf dir/*``: without this, the
        shard's entries are misses and its writes fail until the process ends)."""
        directory = self._kept(shard, create)
        if directory is None:
            return
        yield directory
        if os.fstat(directory).st_nlink != 0:
            return
        fresh = self._open(shard, create)
        if fresh is None:
            return
        # The same number, now the new directory: a thread using it meanwhile sees the old or the new
        # one, never a file another open got under a number closed here.
        os.dup2(fresh, directory, inheritable=False)
        os.close(fresh)
        yield directory

    def close(self) -> None:
        with self._lock:
            descriptors, self._descriptors = list(self._descriptors.values()), {}
        for descriptor in descriptors:
            with contextlib.suppress(OSError):
                os.close(descriptor)
