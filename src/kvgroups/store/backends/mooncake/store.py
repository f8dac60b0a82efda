"""``mooncake://``: Mooncake Store, the distributed pool of the nodes' DRAM that serving fleets share KV through.

A master keeps which client's segment holds which key; values move between clients' segments and
kvgroups' own buffers by Mooncake's transfer engine (TCP or RDMA), in batches: a batch's values are
written from where the caller holds them and read into one buffer of the read's own, each in one call
(``batch_upsert_from``, ``batch_get_into``); a batch's existence is one call (``batch_is_exist``). Keys
carry kvgroups' prefix, so that ``clear`` on a shared pool removes nothing of anyone else's.

What Mooncake does on its own is a miss here, never a wrong answer: it evicts entries when its
segments fill, and the entries a client's segment held leave with the client. A read of an entry
that went is a miss (the chunk store counts entries that vanished after a lookup promised them); a
value that does not check out is the codec's to catch (checksum or MAC). A master that is down or
hung fails a whole call, which the store's owner backs off once (:mod:`kvgroups.store.backends.health`);
one key's holder unreachable is that key's miss. The client and its timeouts:
:mod:`kvgroups.store.backends.mooncake.client`; the URL's options: :mod:`kvgroups.store.backends.mooncake.settings`.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvgroups.store.backends.base import (
    ByteStore,
    Stored,
    StoreError,
    UnacknowledgedWriteError,
    Value,
    check_value,
)
from kvgroups.store.backends.mooncake.client import ABSENT, FULL, TOO_SMALL, UNREACHABLE, MooncakeClient
from kvgroups.store.backends.mooncake.settings import MooncakeSettings
from kvgroups.store.backends.read_buffers import BufferPool

KEY_PREFIX = "kvgroups:"
# A whole read (no max_bytes) of a value replaced by a longer one between its size and its bytes is tried again.
_WHOLE_READ_TRIES = 3
_GREW = memoryview(b"")  # a value longer than the size asked before reading it (compared by identity)
# The most the master's key listing may send (a hostile or confused server must not exhaust memory).
_MAX_LISTING_BYTES = 256 << 20


def _address(view: memoryview) -> int:
    """Where a contiguous byte view's memory starts (ctypes for a writable one, a tenth of NumPy's cost;
    NumPy for a read-only one)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    address: int = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
    return address


class MooncakeStore(ByteStore):
    """Entries in a Mooncake Store pool."""

    tier_name = "mooncake"
    shared = True

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self.url = settings.url  # a Mooncake URL holds no secret
        self.client = MooncakeClient(settings)
        self._config = self.client.replicate_config()
        self._buffers = BufferPool()
        self._register = settings.protocol == "rdma"

    # --- writes ---------------------------------------------------------------------------------------------
    def put(self, key: str, value: Value) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: Sequence[tuple[str, Value]]) -> None:
        """Write every value from where it is (upserts: a key written again is replaced); raises when any is
        not saved, after trying them all."""
        if not items:
            return
        views = [memoryview(check_value(key, value)).cast("B") for key, value in items]
        names = [KEY_PREFIX + key for key, _ in items]
        codes = self._transfer("PUT", "batch_upsert_from", names, views, self._config)
        failed = [code for code in codes if code != 0]
        if not failed:
            return
        if len(failed) == len(codes) and all(code in UNREACHABLE or code in FULL for code in failed):
            raise self.client.failed(f"PUT {len(codes)} value(s)", failed)
        raise UnacknowledgedWriteError(f"{self.url}: {len(failed)} of {len(codes)} value(s) not saved (Mooncake "
                                       f"answered {failed[0]})")

    # --- reads ----------------------------------------------------------------------------------------------
    def get(self, key: str, max_bytes: int | None = None) -> Stored | None:
        return self.get_many([key], max_bytes)[0]

    def get_many(self, keys: Sequence[str], max_bytes: int | None = None) -> list[Stored | None]:
        """Every value read in one call into one buffer of this read's own, ``max_bytes + 1`` bytes a value
        (a longer one is read only that far); a value whose holder cannot be reached is a miss. Without
        ``max_bytes``, each value's size is asked first (a value replaced by a longer one meanwhile is read
        again). A value being written (a key written again) is not readable until it is whole: a miss."""
        if not keys:
            return []
        names = [KEY_PREFIX + key for key in keys]
        if max_bytes is not None:
            return self._read(names, [max_bytes + 1] * len(names), cut=True)
        values: list[Stored | None] = [None] * len(names)
        pending = list(range(len(names)))
        for _ in range(_WHOLE_READ_TRIES):
            sizes = self._sizes([names[index] for index in pending])
            if sizes and all(size in UNREACHABLE for size in sizes):
                raise self.client.failed(f"GET SIZE {len(sizes)} value(s)", sizes)
            asked = [(index, size) for index, size in zip(pending, sizes, strict=True) if size >= 0]
            if any(size < 0 and size not in ABSENT for size in sizes):
                self.note_unanswered()
            read = self._read([names[index] for index, _ in asked], [size for _, size in asked], cut=False)
            pending = []
            for (index, _), value in zip(asked, read, strict=True):
                if value is _GREW:
                    pending.append(index)
                else:
                    values[index] = value
            if not pending:
                break
        return values

    def _read(self, names: list[str], slots: list[int], *, cut: bool) -> list[Stored | None]:
        """``names`` into ``slots`` bytes each; a value longer than its slot is read that far (``cut``) or
        answered :data:`_GREW`."""
        if not names:
            return []
        # Every byte a caller sees was read into it (a zero-filled buffer would cost a pass of its own); a buffer
        # of an earlier batch whose values are all dropped, its pages already there.
        buffer = self._buffers.take(sum(slots))
        starts = np.concatenate(([0], np.cumsum(slots)[:-1])).tolist()
        whole = memoryview(buffer.data).cast("B")
        views = [whole[start:start + slot] for start, slot in zip(starts, slots, strict=True)]
        base = buffer.__array_interface__["data"][0]
        codes = self._transfer("GET", "batch_get_into", names, views, addresses=[base + start for start in starts])
        if all(code in UNREACHABLE for code in codes):
            raise self.client.failed(f"GET {len(names)} value(s)", codes)
        values: list[Stored | None] = []
        for name, view, code in zip(names, views, codes, strict=True):
            if code >= 0:
                values.append(view[:code])
            elif code in TOO_SMALL:
                values.append(self._first_bytes(name, view) if cut and view.nbytes else _GREW)
            else:
                if code not in ABSENT:
                    self.note_unanswered()  # its holder unreachable: says nothing of whether it is stored
                values.append(None)
        return values

    def _sizes(self, names: list[str]) -> list[int]:
        return [int(self.client.call("GET SIZE", "get_size", name)) for name in names]

    def _first_bytes(self, name: str, view: memoryview) -> Stored | None:
        """The first ``view.nbytes`` bytes of a value longer than that, read into ``view`` (its readers see
        it is too long without it being read whole)."""
        size, address = view.nbytes, _address(view)
        # Ranged reads take only registered memory (whatever the protocol): registered for this rare read.
        with self._registered([address], [size]) as registered:
            if not registered:
                return None
            answer = self.client.call("GET RANGE", "get_into_ranges", [address], [[name]], [[[0]]], [[[0]]],
                                      [[[size]]], keep=view)
        got = answer[0][0][0] if answer and answer[0] and answer[0][0] else -1
        return view if got == size else None

    def _transfer(self, action: str, method: str, names: list[str], views: list[memoryview],
                  *extra: Any, addresses: list[int] | None = None) -> list[int]:
        """A batch call moving ``views`` (at ``addresses`` where the caller knows them; kept alive until the
        call returns, even past the timeout)."""
        if addresses is None:
            addresses = [_address(view) if view.nbytes else 0 for view in views]
        sizes = [view.nbytes for view in views]
        # TCP moves any memory of this process; RDMA only memory registered with the transfer engine.
        with self._registered(addresses, sizes) if self._register else contextlib.nullcontext():
            codes = self.client.call(f"{action} {len(names)} value(s)", method, names, addresses, sizes, *extra,
                                     keep=views)
        if not isinstance(codes, list) or len(codes) != len(names):
            raise StoreError(f"{self.url}: {method} answered {len(codes) if isinstance(codes, list) else codes!r} "
                             f"results for {len(names)} keys")
        return [int(code) for code in codes]

    @contextlib.contextmanager
    def _registered(self, addresses: list[int], sizes: list[int]) -> Iterator[bool]:
        """The buffers registered with the transfer engine for as long as the block runs; whether all were."""
        done = [address for address, size in zip(addresses, sizes, strict=True)
                if size and self.client.call("register", "register_buffer", address, size) == 0]
        try:
            yield len(done) == sum(1 for size in sizes if size)
        finally:
            for address in done:
                self.client.call("unregister", "unregister_buffer", address)

    # --- lookups and housekeeping ---------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        answers = [int(found) for found in self.client.call(f"EXIST {len(keys)} keys", "batch_is_exist",
                                                            [KEY_PREFIX + key for key in keys])]
        if len(answers) != len(keys) or all(found < 0 for found in answers):
            raise self.client.failed(f"EXIST {len(keys)} keys", [min(answers, default=-1)])
        if any(found < 0 for found in answers):
            self.note_unanswered()
        return [found == 1 for found in answers]

    def delete(self, key: str) -> bool:
        # Forced: a lease (held for a while after any read) would keep a corrupt entry being discarded.
        code = int(self.client.call("DELETE", "remove", KEY_PREFIX + key, True))
        if code in ABSENT:
            return False
        if code < 0:
            raise self.client.failed("DELETE", [code])
        return True

    def size_of(self, key: str) -> int | None:
        size = int(self.client.call("GET SIZE", "get_size", KEY_PREFIX + key))
        if size in ABSENT:
            return None
        if size < 0:
            raise self.client.failed("GET SIZE", [size])
        return size

    def iter_keys(self) -> Iterator[str]:
        """kvgroups' keys in the pool, as the master's admin server lists them (``admin=``)."""
        if not self.settings.admin:
            raise StoreError(f"{self.url}: listing keys needs the master's admin server: admin=http://HOST:PORT")
        try:
            with urllib.request.urlopen(self.settings.admin.rstrip("/") + "/get_all_keys",
                                        timeout=self.settings.timeout_seconds) as response:
                listing = response.read(_MAX_LISTING_BYTES + 1)
        except OSError as error:
            raise StoreError(f"{self.url}: cannot list keys at {self.settings.admin}: {error}") from error
        if len(listing) > _MAX_LISTING_BYTES:
            raise StoreError(f"{self.url}: the master's key listing is over {_MAX_LISTING_BYTES} bytes")
        for line in listing.decode("utf-8", "replace").splitlines():
            if line.startswith(KEY_PREFIX):
                yield line[len(KEY_PREFIX):]

    def clear(self) -> int:
        """Remove every entry of kvgroups' from the pool (nobody else's); how many went."""
        count = int(self.client.call("CLEAR", "remove_by_regex", "^" + re.escape(KEY_PREFIX), True))
        if count < 0:
            raise self.client.failed("CLEAR", [count])
        return count

    def close(self) -> None:
        self.client.close()
