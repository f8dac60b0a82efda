"""The first copy of an entry that checks out, across a tier list: one reading protocol for every reader.

A value read for an entry may be corrupt (a flipped byte, a torn write, another writer's bytes). The reader
discards that copy (its caller counts and logs it) and, where a later tier of a tier list holds another
copy, reads that one and checks it in turn: at most one try per tier. Chunk stores' loads and entry
reads (:mod:`~kvgroups.store.chunks.prefix_reads`) and SGLang's page reads
(:mod:`kvgroups.integrations.sglang.page_store`) all read this way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvgroups.store.backends.base import Stored
from kvgroups.store.entries.codec import CorruptEntryError, EntryInfo, view_entry
from kvgroups.store.entries.secret import StoreSecret


def first_good_copy(value: Stored | None, info: EntryInfo, *, secret: StoreSecret | None, tries: int,
                    discard: Callable[[CorruptEntryError, Stored], bool],
                    read_again: Callable[[], Stored | None]) -> tuple[torch.Tensor, Stored] | None:
    """The tensor of the first copy that checks out as ``info``, a view of the value it came from, and that
    value; None when a copy is missing, or none of ``tries`` copies checks out. Starts with ``value``; after a
    copy that does not, ``discard(error, value)`` deletes it and says whether another tier holds one, which
    ``read_again()`` then reads (None when missing or when the read failed, the caller's failure counted)."""
    for attempt in range(tries):
        if value is None:
            return None
        try:
            return view_entry(value, info, secret=secret), value
        except CorruptEntryError as error:
            if not discard(error, value) or attempt == tries - 1:
                return None
            value = read_again()
    return None
