"""Stored KV chunks: prefix keys, byte stores (memory, disk, Valkey/Redis, tiered) and the chunk store.

``open_store(url)`` opens a byte store; ``KVChunkStore(metadata, store)`` keeps a model's chunks
in it, per group, keyed by ``prefix_keys``.
"""

from kvgroups.store.base import ByteStore, EntryTooLargeError, StoreError, StoreFullError, StoreStats, StoreTimeoutError
from kvgroups.store.chunk_store import KVChunkStore
from kvgroups.store.codec import CorruptEntryError, EntryInfo, decode_entry, encode_entry
from kvgroups.store.files import FileStore
from kvgroups.store.keys import chunk_namespace, prefix_keys
from kvgroups.store.memory import MemoryStore
from kvgroups.store.metrics import StoreMetrics, TierMetrics
from kvgroups.store.prefixes import GroupPrefix, LoadedEntries, LoadedPrefix, StoredPrefix
from kvgroups.store.redis_store import RedisStore
from kvgroups.store.secret import StoreSecret
from kvgroups.store.tiered import TieredStore
from kvgroups.store.urls import open_store

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
