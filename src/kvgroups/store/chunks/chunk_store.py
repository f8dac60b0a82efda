"""``KVChunkStore``: chunks of every group saved per (chunk, group), and prefixes found and loaded whole.

Each group is asked only for what it keeps (:mod:`kvgroups.store.chunks.prefixes`). ``lookup`` returns
the longest boundary at which every group has all of that; ``load`` reads exactly it and checks
every entry (key, fingerprint, group, chunk, dtype, shape, checksum); those live in
:mod:`kvgroups.store.chunks.prefix_reads`, saves and the store's lifetime here. A store that is down, full
or corrupt costs misses, logged, never an exception in the request and never another request's KV.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import torch

from kvgroups.core.checks import int_at_least, is_int_at_least
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.base import ByteStore, EntryTooLargeError, UnacknowledgedWriteError
from kvgroups.store.backends.health import Backoff, RateLimitedLog
from kvgroups.store.backends.urls import StoreArg, open_store
from kvgroups.store.chunks.prefix_reads import PrefixReads
from kvgroups.store.chunks.prefixes import needed_chunks
from kvgroups.store.chunks.seen import SeenEntries
from kvgroups.store.chunks.writer import BackgroundWriter
from kvgroups.store.entries.codec import EntryInfo, check_tensor, encode_entry
from kvgroups.store.entries.keys import TokenIds, chunk_namespace, prefix_keys, salt_bytes
from kvgroups.store.entries.secret import ENVIRONMENT_VARIABLE, StoreSecret
from kvgroups.store.metrics.counters import DROP_BACKED_OFF, DROP_QUEUE_FULL, REGISTRY, StoreMetrics
from kvgroups.store.metrics.prometheus import install as install_prometheus

logger = logging.getLogger(__name__)

# Saves the background writer may hold before it drops new ones (counted).
DEFAULT_MAX_PENDING_BYTES = 1 << 30


class KVChunkStore(PrefixReads):
    """A model's KV chunks, one entry per (chunk, group), keyed by prefix, in a byte store.

    Args:
        metadata: the model's :class:`~kvgroups.LMCacheMetadata` with its groups built; its
            fingerprint names every entry and its ``chunk_size`` is the tokens per chunk.
        store: a store URL (``memory://``, ``file:///dir``, ``redis://host:port/db``, ...), a list
            of URLs (tiers, fastest first) or a :class:`~kvgroups.store.ByteStore`. A store
            opened from URLs here is closed by :meth:`close`; a store passed in is the caller's.
        salt: the tenant's salt: chunks saved under one salt are never served under another.
        secret: the deployment's secret (str, bytes or a :class:`~kvgroups.store.StoreSecret`;
            None reads ``$KVGROUPS_STORE_SECRET`` when set). With one, keys are keyed (nobody
            without it can compute or confirm one) and every entry carries a MAC (an entry written
            without it is a miss). Without one, whoever can read the store can read prompts' KV and
            whoever can write it can change answers.
        encrypt: also encrypt every entry's bytes (AES-256-GCM; needs a secret).
        max_pending_bytes: bytes of saves the background writer may hold; a save beyond it is
            dropped at once (counted), never waited for.

    Raises:
        TypeError: ``metadata`` is not an ``LMCacheMetadata``.
        KVGroupsError: the metadata has no groups, or ``store`` is a URL kvgroups cannot open.
    """

    def __init__(self, metadata: LMCacheMetadata, store: StoreArg, *, salt: str | bytes = "",
                 secret: str | bytes | StoreSecret | None = None, encrypt: bool = False,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        if not isinstance(metadata, LMCacheMetadata):
            raise TypeError(f"metadata must be an LMCacheMetadata, got {type(metadata).__name__}")
        groups = list(metadata.kv_layer_groups_manager.kv_layer_groups)
        if not groups:
            raise KVGroupsError("metadata has no layer groups; build them (build_kv_layer_groups) first")
        self.groups: list[KVLayerGroupInfo] = groups
        self.chunk_size = metadata.chunk_size
        self.fingerprint = metadata.fingerprint()
        self.namespace = chunk_namespace(metadata, salt)
        self.secret = StoreSecret.resolve(secret)
        if encrypt and self.secret is None:
            raise KVGroupsError(f"encrypt=True needs a secret (secret=, or ${ENVIRONMENT_VARIABLE})")
        self.encrypt = encrypt
        self._owns_store = not isinstance(store, ByteStore)
        self.store = open_store(store)
        # Every count since it was opened; exported to Prometheus when prometheus-client is there.
        self.stats = StoreMetrics(tier=self.store.tier_name, num_groups=len(groups),
                                  tiers=[tier.tier_metrics for tier in self.store.tiers])
        self._writer = BackgroundWriter(max_pending_bytes)
        self._log = RateLimitedLog(logger)
        self.seen = SeenEntries()
        self._backoff = Backoff(self.store.url, self._log)
        REGISTRY.add(self, self.stats)
        install_prometheus()

    # --- keys and needs -------------------------------------------------------------------
    def keys(self, token_ids: TokenIds, *, request_salt: str | bytes = "") -> list[str]:
        """One prefix key per full chunk of ``token_ids``.

        ``request_salt`` narrows the keys to requests sharing it (a tenant's cache salt, a LoRA
        adapter, the multimodal inputs behind placeholder tokens): the same tokens with
        another salt never share a key.
        """
        request_salt = salt_bytes(request_salt, "request_salt")
        namespace = self.namespace + b"\0request-salt\0" + request_salt if request_salt else self.namespace
        return prefix_keys(token_ids, self.chunk_size, namespace, secret=self.secret)

    def needed_chunks(self, group_index: int, num_chunks: int) -> range:
        """The chunks group ``group_index`` needs to continue after ``num_chunks`` full chunks."""
        return needed_chunks(self.groups[group_index].spec, num_chunks, self.chunk_size)

    def entry_info(self, key: str, group_index: int, chunk_index: int) -> EntryInfo:
        """What group ``group_index``'s entry of chunk ``chunk_index`` (prefix key ``key``) must be."""
        group = self.groups[group_index]
        return EntryInfo(
            key=self.entry_key(key, group_index), fingerprint=self.fingerprint, group_index=group_index,
            chunk_index=chunk_index, dtype=group.dtype, shape=tuple(group.chunk_shape(self.chunk_size)),
        )

    def _failed(self, action: str, error: OSError) -> None:
        self.stats.failed_reads += action != "save"
        self.store.record_error(error)
        self._backoff.failed(action, error)

    def gauges(self) -> dict[str, dict[tuple[str, ...], float]]:
        """What is true now, for the metrics: queued save bytes, which tiers are backed off, and what each
        tier knows of what it holds."""
        tier = self.store.tier_name
        found: dict[str, dict[tuple[str, ...], float]] = {
            "save_queue_bytes": {(tier,): float(self._writer.pending_bytes)},
            "backed_off": {(tier,): float(not self._backoff.available()),
                           **{(name,): float(down) for name, down in self.store.backed_off().items()}},
        }
        for store in self.store.tiers:
            for name, value in store.gauges().items():
                found.setdefault(name, {})[(store.tier_name,)] = value
        return found

    # --- save -----------------------------------------------------------------------------
    def save(self, token_ids: TokenIds, chunk_index: int, tensors: Sequence[torch.Tensor], *,
             keys: Sequence[str] | None = None) -> None:
        """Save chunk ``chunk_index`` of ``token_ids``: one tensor per group, in the background.

        Token groups give the chunk's tokens as ``pack`` returns them (``group.chunk_shape(chunk_size)``);
        recurrent groups their state *after* the chunk (``[1, num_layers, 1, state_elements]``). The tensors
        are written later: do not modify them afterwards (chunks from ``KVTransfer.pack`` without ``out=``
        are safe). ``keys``, from :meth:`keys` of the same tokens, saves hashing them again. Wrong shapes raise.
        """
        if keys is None:
            keys = self.keys(token_ids[: (chunk_index + 1) * self.chunk_size])
        if not is_int_at_least(chunk_index, 0) or chunk_index >= len(keys):
            raise KVGroupsError(f"chunk_index {chunk_index!r} is not a full chunk of these {len(keys)} chunk(s) of "
                                f"{self.chunk_size} tokens")
        tensors = list(tensors)
        if len(tensors) != len(self.groups):
            raise KVGroupsError(f"save got {len(tensors)} tensors for {len(self.groups)} groups; pass one per group")
        self.save_chunk(keys[chunk_index], chunk_index, dict(enumerate(tensors)))

    def save_chunk(self, key: str, chunk_index: int, tensors: Mapping[int, torch.Tensor], *,
                   release: Callable[[], None] | None = None, ready: Callable[[], None] | None = None,
                   written: Callable[[list[str]], None] | None = None) -> bool:
        """Save the entries of some groups (``group index -> tensor``) of the chunk whose prefix key is
        ``key``; whether the save was queued (False: dropped and counted, the store being backed off
        or the writer's queue full). What :meth:`save` does for every group; a caller with only some
        groups' data for a chunk (a window that moved on, a state not at this boundary) saves those,
        and lookups treat the others as missing. ``release`` is called once the tensors are no longer
        needed (written, failed or dropped); ``ready`` before they are read (waits for the copy filling
        them); ``written`` with the entry keys once they are written (never for a dropped or failed save).
        """
        int_at_least("chunk_index", chunk_index, 0)
        bad_groups = [index for index in tensors if not (isinstance(index, int) and 0 <= index < len(self.groups))]
        if bad_groups:
            raise KVGroupsError(f"save names groups {bad_groups}; these {len(self.groups)} groups are 0.."
                                f"{len(self.groups) - 1}")
        infos = [self.entry_info(key, index, chunk_index) for index in sorted(tensors)]
        for info in infos:
            check_tensor(tensors[info.group_index], info)
        available = self._backoff.available()
        queued = bool(infos) and available and self._writer.submit(
            lambda: self._write(tensors, infos, release, ready, written), sum(info.tensor_bytes for info in infos))
        if not queued:
            if infos:
                self.stats.dropped(DROP_QUEUE_FULL if available else DROP_BACKED_OFF)
                self._log.warning("dropped", "chunk store %s: a save was dropped (store backed off, or %d bytes of "
                                  "saves pending); %d dropped so far", self.store.url, self._writer.pending_bytes,
                                  self.stats.dropped_saves)
            if release is not None:
                release()
        return queued

    def _write(self, tensors: Mapping[int, torch.Tensor], infos: list[EntryInfo], release: Callable[[], None] | None,
               ready: Callable[[], None] | None, written: Callable[[list[str]], None] | None) -> None:
        begin = time.perf_counter()
        try:
            if ready is not None:
                ready()
            values = [(info.key, encode_entry(tensors[info.group_index], info, secret=self.secret,
                                              encrypt=self.encrypt)) for info in infos]
        finally:
            if release is not None:
                release()  # encoded: the tensors' memory may be reused
        try:
            self.store.put_many(values)
        except (OSError, EntryTooLargeError) as error:
            self.stats.failed_saves += 1
            if isinstance(error, OSError) and not isinstance(error, UnacknowledgedWriteError):
                self._failed("save", error)
            else:  # the store answers: only this chunk is not saved (a master down, its replicas behind)
                self.store.record_error(error)
                self._log.warning("unsaved", "chunk store %s: a chunk was not saved as asked (%d failed saves so "
                                  "far): %s", self.store.url, self.stats.failed_saves, error)
            raise
        self.stats.saved(sum(len(value) for _, value in values), time.perf_counter() - begin)
        self.seen.stored(key for key, _ in values)
        if written is not None:
            written([key for key, _ in values])

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save so far is written (or has failed and been logged), up to ``timeout``
        seconds; whether they all were."""
        return self._writer.flush(timeout)

    # --- lifetime -------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (up to ``timeout`` seconds), stop the writer, and close the store when
        this object opened it; whether every save was written."""
        written = self._writer.close(timeout)
        if self._owns_store:
            self.store.close()
        return written

    def __enter__(self) -> KVChunkStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
