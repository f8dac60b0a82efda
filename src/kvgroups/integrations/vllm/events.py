"""KV events: what the store holds, told to KV-aware routers as vLLM's own ``BlockStored`` / ``BlockRemoved``.

With ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` vLLM publishes the events of
its KV cache manager and of its connector (``take_events``) from the scheduler. The connector adds:

- ``BlockStored`` for the blocks of a chunk, per vLLM KV-cache group, once every rank holding that
  group has written its entries of the chunk: the workers report the entry keys they wrote
  (:class:`EntryReports`, through vLLM's ``KVConnectorWorkerMetadata`` of the next step), so a
  save that was dropped or failed is never announced. The events are those vLLM's prefix cache
  would publish for the same blocks (its block hashes, parent hash, token ids, LoRA, extra keys,
  group index and spec kind), with ``medium`` naming the kind of the store's last tier
  (:data:`MEDIUM_OF_TIER`). A recurrent group's entry is the
  state after the chunk: one event whose block is the whole chunk (``block_size`` the chunk size,
  the hash of the chunk's last block).
- The same for chunks a load restored, the first time this process serves them: a router learns
  every server that can serve a prefix cheaply, whoever stored it.
- ``BlockRemoved`` for the entries a worker deleted as corrupt, or its store's last tier (the one the
  medium names) evicted, for the chunk's blocks of that group.

What no process here can know (another process's deletes, a server's own eviction, a file tier's
files removed from outside) is never announced; see docs/vllm.md for what a router should do.
Everything here runs only where vLLM's KV events are on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.plans import LoadPlan, SavePlan
from kvgroups.store.backends.base import Stored
from kvgroups.store.chunks.chunk_store import KVChunkStore
from kvgroups.store.entries.codec import CorruptEntryError, EntryInfo

# The medium an event names, by the kind of the store's last (most durable) tier: names the routers
# know (Dynamo's StorageTier reads CPU as host memory, DISK as disk, EXTERNAL as a shared store;
# llm-d weighs each medium, lowercased, as configured). vLLM's own MEDIUM_STORAGE is "STORAGE".
MEDIUM_OF_TIER = {"memory": "CPU", "file": "DISK", "redis": "EXTERNAL", "redis-cluster": "EXTERNAL"}
# Events waiting for their entries, and entries announced (to find what a removal removes): bounded,
# oldest forgotten first (a forgotten one is at worst not announced, never announced wrongly).
MAX_TRACKED = 1 << 16
_STORED_FIELDS = frozenset(BlockStored.__struct_fields__)
_LOW_64_BITS = (1 << 64) - 1


@dataclass
class KVGroupsWorkerEvents(KVConnectorWorkerMetadata):
    """What a worker's store did since the last step: entry keys written, entry keys deleted as corrupt."""

    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVGroupsWorkerEvents):
            return KVGroupsWorkerEvents(self.written + other.written, self.removed + other.removed)
        return self


class EntryReports:
    """A worker's reports, collected from the writer and loading threads, taken once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written: list[str] = []
        self._removed: list[str] = []

    def written(self, keys: list[str]) -> None:
        with self._lock:
            self._written.extend(keys)

    def removed(self, key: str) -> None:
        with self._lock:
            self._removed.append(key)

    def evicted(self, keys: list[str]) -> None:
        """Keys the store's last tier evicted (its eviction listener): their blocks are gone from its medium."""
        with self._lock:
            self._removed.extend(keys)

    def take(self) -> KVGroupsWorkerEvents | None:
        with self._lock:
            written, self._written, removed, self._removed = self._written, [], self._removed, []
        return KVGroupsWorkerEvents(written, removed) if written or removed else None


class ReportingChunkStore(KVChunkStore):
    """A worker's chunk store that reports the entries it deletes as corrupt (gone from every tier: one a
    later tier still holds is served from there)."""

    reports: EntryReports | None = None

    def discard_corrupt(self, info: EntryInfo, error: CorruptEntryError, value: Stored) -> bool:
        another = super().discard_corrupt(info, error, value)
        if self.reports is not None and not another:
            self.reports.removed(info.key)
        return another


@dataclass
class _Chunk:
    """One chunk's blocks of one vLLM group, as an event, and the entry keys that hold it."""

    stored: BlockStored
    entries: tuple[str, ...]
    missing: set[str]


class StoreEvents:
    """The scheduler side's events: built when a save or a load is planned, published when it is done."""

    def __init__(self, deployment: Deployment, rank_stores: Sequence[KVChunkStore], kv_cache_config: Any) -> None:
        self.deployment = deployment
        self.rank_stores = rank_stores
        self.chunk_size = deployment.settings.chunk_size
        self.specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        self.hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
        self.medium = MEDIUM_OF_TIER.get(rank_stores[0].store.tiers[-1].tier_name, "STORAGE")
        self._saving: OrderedDict[str, _Chunk] = OrderedDict()  # by each entry key it waits for
        self._loading: dict[str, list[_Chunk]] = {}  # by request id
        # Requests whose synchronous load runs in this step's forward: its output says how it went.
        self._loading_now: set[str] = set()
        self._announced: OrderedDict[str, _Chunk] = OrderedDict()  # by entry key
        self._ready: list[KVCacheEvent] = []

    def bind_block_pool(self, block_pool: Any) -> None:
        self.hash_block_size = int(getattr(block_pool, "hash_block_size", 0) or self.hash_block_size)

    # --- planned ---------------------------------------------------------------------------
    def saving(self, request: Any, plan: SavePlan) -> None:
        keys = self._keys(plan.tokens, plan.request_salt)
        for chunk in plan.chunks:
            for event in self._chunk_events(request, keys, chunk):
                for key in event.entries:
                    self._track(self._saving, key, event)

    def loading(self, request: Any, plan: LoadPlan) -> None:
        """A load planned: the chunks it reads, per group (a window needs only its last ones), are
        announced once it succeeded; those vLLM's own prefix cache served are not read."""
        num_chunks = plan.num_tokens // self.chunk_size
        store, keys = self.rank_stores[0], self._keys(plan.tokens, plan.request_salt)
        self._loading[plan.request_id] = [
            event for chunk in range(plan.local_tokens // self.chunk_size, num_chunks)
            for event in self._chunk_events(request, keys, chunk)
            if any(chunk in store.needed_chunks(member, num_chunks)
                   for member in self.deployment.engine_groups[event.stored.group_idx].members)]
        if not plan.asynchronous:
            self._loading_now.add(plan.request_id)

    # --- done ------------------------------------------------------------------------------
    def update(self, connector_output: Any) -> None:
        """A step's reports: entries written or deleted (the workers'), loads finished or failed."""
        reports = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(reports, KVGroupsWorkerEvents):
            for key in reports.written:
                event = self._saving.pop(key, None)
                if event is not None:
                    event.missing.discard(key)
                    if not event.missing:
                        self._announce(event)
            for key in reports.removed:
                self._remove(key)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for request_id in getattr(connector_output, "finished_recving", None) or ():
            self._served(request_id, succeeded=request_id not in failed)
        # This step's synchronous loads ran before its forward; vLLM says nothing of them but the
        # blocks that failed to load (of any of them).
        failed_blocks = bool(getattr(connector_output, "invalid_block_ids", None))
        for request_id in self._loading_now:
            self._served(request_id, succeeded=not failed_blocks)
        self._loading_now.clear()

    def take(self) -> list[KVCacheEvent]:
        ready, self._ready = self._ready, []
        return ready

    def forget(self, request_id: str) -> None:
        """A request finished: its load will not be reported (unless it ran in this step, whose output
        vLLM hands over after it frees the step's finished requests)."""
        if request_id not in self._loading_now:
            self._loading.pop(request_id, None)

    def reset(self) -> None:
        """The server's keys moved to a new generation (vLLM publishes AllBlocksCleared itself)."""
        self._saving.clear()
        self._loading.clear()
        self._loading_now.clear()
        self._announced.clear()

    # --- helpers ---------------------------------------------------------------------------
    def _served(self, request_id: str, succeeded: bool) -> None:
        """A request's load ended: what it read is announced if it succeeded, once, whoever stored it."""
        for event in self._loading.pop(request_id, []):
            if succeeded and event.entries[0] not in self._announced:
                self._announce(event)

    def _announce(self, event: _Chunk) -> None:
        self._ready.append(event.stored)
        for key in event.entries:
            self._track(self._announced, key, event)

    def _remove(self, key: str) -> None:
        """An entry deleted (corrupt) or evicted: its chunk's blocks of that group are gone, whoever announced them."""
        event = self._announced.pop(key, None) or next(
            (event for events in self._loading.values() for event in events if key in event.entries), None)
        if event is None:
            return
        for other in event.entries:
            self._announced.pop(other, None)
        self._ready.append(BlockRemoved(block_hashes=event.stored.block_hashes, medium=self.medium,
                                        group_idx=event.stored.group_idx))

    @staticmethod
    def _track(table: OrderedDict[str, _Chunk], key: str, event: _Chunk) -> None:
        table[key] = event
        table.move_to_end(key)
        while len(table) > MAX_TRACKED:
            table.popitem(last=False)

    def _keys(self, tokens: Any, salt: str) -> list[list[str]]:
        """Every rank's prefix keys of ``tokens``' chunks (the workers compute the same from the plan)."""
        return [store.keys(tokens, request_salt=salt) for store in self.rank_stores]

    def _chunk_events(self, request: Any, keys_by_rank: list[list[str]], chunk: int) -> list[_Chunk]:
        """Per vLLM group, chunk ``chunk``'s event and the entry keys (every owning rank's) holding it."""
        keys = [rank_keys[chunk] for rank_keys in keys_by_rank]
        events = []
        for engine_group in self.deployment.engine_groups:
            entries = tuple(
                KVChunkStore.entry_key(keys[rank], member)
                for rank in range(len(self.rank_stores)) for member in engine_group.members
                if member in self.deployment.owned_groups(rank))
            if not entries:
                continue
            block_size = engine_group.block_size if engine_group.token_indexed else self.chunk_size
            if self.hash_block_size and block_size % self.hash_block_size:
                continue  # blocks vLLM hashes in no whole hashes: it announces none of its own for them either
            stored = self._stored(request, engine_group.index, chunk, block_size)
            events.append(_Chunk(stored, entries, set(entries)))
        return events

    def _stored(self, request: Any, group_index: int, chunk: int, block_size: int) -> BlockStored:
        """vLLM's BlockStored of the blocks of ``block_size`` tokens that chunk ``chunk`` covers in a group."""
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size or block_size, block_size)
        first, end = chunk * self.chunk_size // block_size, (chunk + 1) * self.chunk_size // block_size
        extra_keys: list[Any] = []
        mm_index = 0
        for block in range(first, end):
            keys, mm_index = generate_block_hash_extra_keys(request, block * block_size, (block + 1) * block_size,
                                                            mm_index)
            extra_keys.append(keys)
        spec = self.specs[group_index]
        lora = getattr(request, "lora_request", None)
        fields: dict[str, Any] = {
            "block_hashes": _external_hashes([hashes[block] for block in range(first, end)]),
            "parent_block_hash": maybe_convert_block_hash(hashes[first - 1]) if first else None,
            "token_ids": list(request.all_token_ids[first * block_size:end * block_size]),
            "block_size": block_size, "lora_id": lora.adapter_id if lora else None, "medium": self.medium,
            "lora_name": lora.name if lora else None, "extra_keys": to_event_extra_keys(extra_keys),
            "group_idx": group_index, "kv_cache_spec_kind": get_kv_cache_spec_kind(spec).value,
            "kv_cache_spec_sliding_window": get_kv_cache_spec_sliding_window(spec),
        }
        return BlockStored(**{name: value for name, value in fields.items() if name in _STORED_FIELDS})


def _external_hashes(hashes: list[Any]) -> list[Any]:
    """vLLM's ``maybe_convert_block_hash`` of each hash, asked once per list: it reads an environment
    variable at every call, which for long prompts was most of what events cost the scheduler. Its
    answer for the first hash decides (bytes as they are, or their low 64 bits as an int, checked)."""
    if not hashes:
        return []
    first = maybe_convert_block_hash(hashes[0])
    if not isinstance(first, int) or first != int.from_bytes(hashes[0], "big") & _LOW_64_BITS:
        return [first, *(maybe_convert_block_hash(block_hash) for block_hash in hashes[1:])]
    return [first, *(int.from_bytes(block_hash, "big") & _LOW_64_BITS for block_hash in hashes[1:])]
