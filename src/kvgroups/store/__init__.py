"""Stored KV chunks, in four rooms (each may import what its line says, besides the core and errors):

- ``metrics/``: what the stores report (counters, histograms, the Prometheus collector); nothing else.
- ``entries/``: what a stored value is (the entry format, prefix keys, a model's identity, the secret);
  ``metrics``.
- ``backends/``: the byte stores (memory, files, Valkey/Redis and its cluster, tier lists, opened by
  URL); ``metrics``.
- ``chunks/``: ``KVChunkStore`` on top, a model's chunks per group in a byte store, keyed by
  ``prefix_keys``; every other room.

``open_store(url)`` opens a byte store; ``KVChunkStore(metadata, store)`` keeps a model's chunks
in it, per group. An engine's integration that stores pages of its own (SGLang's) uses the byte
stores and the entry format without the chunk store.
"""

from kvgroups.store.backends.base import (
    ByteStore,
    EntryTooLargeError,
    StoreError,
    StoreFullError,
    StoreStats,
    StoreTimeoutError,
)
from kvgroups.store.backends.files.store import FileStore
from kvgroups.store.backends.memory import MemoryStore
from kvgroups.store.backends.redis.store import RedisStore
from kvgroups.store.backends.tiered import TieredStore
from kvgroups.store.backends.urls import open_store
from kvgroups.store.chunks.chunk_store import KVChunkStore
from kvgroups.store.chunks.prefixes import GroupPrefix, LoadedEntries, LoadedPrefix, StoredPrefix
from kvgroups.store.entries.codec import CorruptEntryError, EntryInfo, decode_entry, encode_entry
from kvgroups.store.entries.keys import chunk_namespace, prefix_keys
from kvgroups.store.entries.secret import StoreSecret
from kvgroups.store.metrics.counters import StoreMetrics, TierMetrics

__all__ = [
    "ByteStore",
    "CorruptEntryError",
    "EntryInfo",
    "EntryTooLargeError",
    "FileStore",
    "GroupPrefix",
    "KVChunkStore",
    "LoadedEntries",
    "LoadedPrefix",
    "MemoryStore",
    "RedisStore",
    "StoreError",
    "StoreFullError",
    "StoreMetrics",
    "StoreSecret",
    "StoreStats",
    "StoreTimeoutError",
    "StoredPrefix",
    "TierMetrics",
    "TieredStore",
    "chunk_namespace",
    "decode_entry",
    "encode_entry",
    "open_store",
    "prefix_keys",
]
