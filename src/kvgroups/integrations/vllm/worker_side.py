"""The connector's worker side: bind vLLM's registered caches, restore planned prefixes, save new chunks.

A load reads each entry once, into a reused buffer, checks it, and copies it into the request's
blocks (:class:`~kvgroups.store.chunks.entry_reads.EntryReader`, then ``KVTransfer.unpack``); entries below vLLM's own
prefix-cache hit are not read. Asynchronous loads run in background threads
(:mod:`~kvgroups.integrations.vllm.loads`) while the engine runs other requests, reported through
``get_transfer_results``: a failed one in ``failed_recving``, so that vLLM recomputes the request under
``kv_load_failure_policy="recompute"``. Synchronous loads run in ``start_load_kv``, before the forward that
needs them; a failed one reports its blocks (``get_block_ids_with_load_errors``), which vLLM recomputes.
Saves run in ``wait_for_save``, after the forward that computed them and before vLLM may hand their blocks
to another request: a copy into host buffers, then encoding and writing on the chunk store's background
writer; a save that fails is logged and costs a later miss. The copies are the data path's (``KVTransfer``).

On a GPU the worker copies as vLLM's own offloading does (:mod:`~kvgroups.datapath.streams`): loads
on a stream of their own and saves on another, launched with the caches' device current in the
launching thread; a save's gather is ordered after the forward by the stream, never by making the
engine thread wait, and goes through a staging buffer per group allocated (and logged) at
registration; the writer waits for the save's event before encoding, and a load is reported only
once its event completed. Every kernel is compiled at registration.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Mapping
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.datapath.buffers import HostBufferPool, ReadBuffers
from kvgroups.datapath.kernels import warm_up
from kvgroups.datapath.streams import DONE, Completion, CopyStream
from kvgroups.datapath.transfer import KVTransfer
from kvgroups.errors import KVGroupsError
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.engine_groups import EngineGroup
from kvgroups.integrations.vllm.events import EntryReports, ReportingChunkStore
from kvgroups.integrations.vllm.loads import BackgroundLoads
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata, LoadPlan, SavePlan, chunk_slots
from kvgroups.integrations.vllm.stats import StatsReporter
from kvgroups.store.chunks.chunk_store import KVChunkStore
from kvgroups.store.chunks.entry_reads import EntryReader
from kvgroups.store.metrics.counters import DROP_NO_BUFFER

logger = logging.getLogger(__name__)

# How long a step that computed nothing waits for an asynchronous load to end (the engine's next step
# starts at once when one does); bounded, so that new requests are admitted as before.
IDLE_WAIT_SECONDS = 0.05
Bound = TypeVar("Bound")

def bound(value: Bound | None) -> Bound:
    """What ``register_kv_caches`` sets up, once it has."""
    if value is None:
        raise KVGroupsError("register_kv_caches was not called before the first load or save")
    return value


class WorkerSide:
    """One worker's caches bound to its rank's chunk store."""

    def __init__(self, deployment: Deployment, rank: int) -> None:
        self.deployment = deployment
        self.rank = rank
        self.chunk_size = deployment.settings.chunk_size
        self.expected = deployment.metadata(rank, deployment.groups, "worker").fingerprint()
        self.store: KVChunkStore | None = None
        self.transfers: list[KVTransfer] = []
        self.load_transfers: list[KVTransfer] = []
        self.engine_groups = deployment.engine_groups
        self.specs = [group.spec for group in deployment.groups]  # each kvgroups group's kind
        self._load_errors: set[int] = set()
        self.loads: BackgroundLoads | None = None
        self.reader: EntryReader | None = None
        self.stats: StatsReporter | None = None  # the store's counts since the last step, for vLLM
        self.device = torch.device("cpu")  # the caches', once registered
        self.load_stream = self.save_stream = CopyStream(self.device)
        self.staging: list[torch.Tensor] | None = None  # per group, where a save gathers on a GPU
        self.host_buffers: HostBufferPool | None = None
        self._registered: dict[str, torch.Tensor] = {}
        self._bound = ""
        self._sync_buffers: ReadBuffers | None = None
        self.shared_store: KVChunkStore | None = None  # rank 0's entries, on the other ranks
        self.shared_reader: EntryReader | None = None
        # The entries written and deleted, for the scheduler's KV events (only where vLLM publishes them).
        self.reports = EntryReports() if deployment.kv_events else None
        # Finished requests whose last saves copy out of their blocks: vLLM frees those once reported.
        self._finishing: list[tuple[str, Completion]] = []

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self._registered = dict(kv_caches)
        metadata = self._bind(self._registered)
        settings = self.deployment.settings
        self.store = ReportingChunkStore(metadata, list(settings.stores), salt=settings.salt, secret=settings.secret,
                                         encrypt=settings.encrypt, max_pending_bytes=settings.max_pending_bytes)
        self.store.reports = self.reports
        if self.reports is not None:  # what the medium's tier evicts is gone from it
            self.store.store.tiers[-1].eviction_listener = self.reports.evicted
        self.reader = EntryReader(self.store)
        self.stats = StatsReporter(self.store.stats)
        self.loads = BackgroundLoads(self._read_buffers)
        if self.rank and self.deployment.shared_groups:  # what every rank holds alike is read under rank 0's keys
            self.shared_store = ReportingChunkStore(self.deployment.metadata(0, self.deployment.groups, "worker"),
                                                    self.store.store, salt=settings.salt, secret=settings.secret,
                                                    encrypt=settings.encrypt)
            self.shared_store.reports = self.reports
            self.shared_reader = EntryReader(self.shared_store)
        # Saves queued when the process exits are written first, whether or not vLLM shuts us down.
        atexit.register(self.close)
        logger.info("KVGroupsConnector rank %d: %s, store %s", self.rank, self._bound, self.store.store.url)

    def unregister(self) -> None:
        """Before vLLM's sleep mode frees the caches (vLLM 0.33): wait for every copy into or out of them,
        then drop every binding to their memory. Loads and saves until :meth:`restore` do nothing."""
        if self.loads is not None:
            self.loads.wait()
        self.save_stream.record().synchronize()  # queued saves' copies out of the caches are done
        self.transfers, self.load_transfers, self.staging = [], [], None
        logger.info("KVGroupsConnector rank %d: caches unregistered (sleep)", self.rank)

    def restore(self) -> None:
        """After vLLM wakes up (vLLM 0.33): bind the caches again, wherever their memory now is."""
        if not self.transfers and self._registered:
            self._bind(self._registered)
            logger.info("KVGroupsConnector rank %d: caches restored (wake-up): %s", self.rank, self._bound)

    def _bind(self, kv_caches: Mapping[str, torch.Tensor]) -> LMCacheMetadata:
        """Check the registered caches against vLLM's config and bind them for copies (kernels compiled);
        the rank's metadata."""
        plan = self.deployment.plan
        missing = [name for name in plan.layers if name not in kv_caches]
        if missing:
            raise KVGroupsError(f"vLLM registered no cache for layers {missing[:4]}")
        values = {name: layer.value(kv_caches[name]) for name, layer in plan.layers.items()}
        groups, _ = plan.build_groups(values)
        metadata = self.deployment.metadata(self.rank, groups, "worker")
        if metadata.fingerprint() != self.expected:
            raise KVGroupsError(
                "the registered caches do not match vLLM's KV-cache config: "
                f"registered {[group.to_dict() for group in groups]}, "
                f"expected {[group.to_dict() for group in self.deployment.groups]}"
            )
        self.transfers = [KVTransfer([group], values) for group in groups]
        # Background loads copy on one thread each: the model's forward has the cores meanwhile.
        self.load_transfers = [KVTransfer([group], values, num_threads=1) for group in groups]
        self.device = device = self.transfers[0].device if self.transfers else torch.device("cpu")
        if self.host_buffers is None:
            self.host_buffers = HostBufferPool(self.deployment.settings.max_pending_bytes, pin=device.type != "cpu")
        self.load_stream, self.save_stream = CopyStream(device), CopyStream(device)
        staging_bytes = 0
        if device.type != "cpu":
            # The device memory saves take beyond vLLM's budget: one chunk per group, reused by every save.
            self.staging = [torch.empty(group.chunk_bytes(self.chunk_size), dtype=torch.uint8, device=device)
                            for group in groups]
            staging_bytes = sum(buffer.numel() for buffer in self.staging)
        kernel = warm_up(device) if self.transfers else "none"
        with self.save_stream.launching():
            for transfer in (*self.transfers, *self.load_transfers):
                transfer.warm_up()
        kinds = ", ".join(f"{group.kind.value} x{len(group.layer_names)}" for group in groups)
        self._bound = (f"{len(groups)} groups ({kinds}), kernels {kernel} on {device} "
                       f"(save staging {staging_bytes / 2**20:.1f} MiB)")
        return metadata

    # --- loads ------------------------------------------------------------------------------
    def load(self, metadata: KVGroupsConnectorMetadata) -> None:
        """Start this step's asynchronous loads; run its synchronous ones (before the forward)."""
        if not self.transfers and self._registered:  # asleep (vLLM drains requests first): nothing to write into
            logger.warning("KVGroupsConnector rank %d: %d loads while the caches are unregistered fail",
                           self.rank, len(metadata.loads))
        for plan in metadata.loads:
            if plan.asynchronous:
                # Beside a forward a load copies on one thread; in a step that computes nothing (every
                # request waits) on all of them.
                transfers = self.transfers if metadata.idle else self.load_transfers
                bound(self.loads).submit(plan.request_id, partial(self._launch, plan, transfers))
                continue
            if self._sync_buffers is None:
                self._sync_buffers = self._read_buffers()
            loaded, copies = self._launch(plan, self.transfers, self._sync_buffers)
            # The forward that reads these blocks runs after the copies, on the GPU; nothing waits here.
            self.load_stream.before_engine(copies)
            if not loaded:
                self._load_errors.update(plan.blocks_written(self.engine_groups))

    def _read_buffers(self) -> ReadBuffers:
        """Where one loading thread reads entries: pinned on a GPU, each refilled once copied from."""
        return ReadBuffers(bound(self.reader).buffer_size(), pin=self.device.type == "cuda")

    def _launch(self, plan: LoadPlan, transfers: list[KVTransfer], buffers: ReadBuffers) -> tuple[bool, Completion]:
        """Restore ``plan`` on the load stream: whether every entry was there, and the end of its copies
        (also of a failed load's, which may have written some blocks before it failed)."""
        with self.load_stream.launching():
            try:
                restored = self._restore(plan, transfers, buffers)
            except Exception:  # a load must never take the engine down: vLLM recomputes what failed
                logger.exception("request %s: restoring %d tokens failed", plan.request_id, plan.num_tokens)
                restored = False
            return restored, self.load_stream.record()

    def _restore(self, plan: LoadPlan, transfers: list[KVTransfer], buffers: ReadBuffers) -> bool:
        """Read every entry the plan needs, once, and copy it into the request's blocks; whether all were there.

        Counted as one load of the tokens it restored beyond vLLM's own prefix-cache hit (none when it failed).
        """
        begin = time.perf_counter()
        restored = self._restore_entries(plan, transfers, buffers)
        bound(self.store).stats.loaded(plan.num_tokens - plan.local_tokens if restored else 0,
                                         time.perf_counter() - begin, short=not restored)
        return restored

    def _restore_entries(self, plan: LoadPlan, transfers: list[KVTransfer], buffers: ReadBuffers) -> bool:
        store = bound(self.store)
        keys = store.keys(plan.tokens, request_salt=plan.request_salt)
        shared_keys = (self.shared_store.keys(plan.tokens, request_salt=plan.request_salt)
                       if self.shared_store is not None else keys)
        num_chunks = plan.num_tokens // self.chunk_size
        for engine_group in self.engine_groups:
            block_ids = np.asarray(plan.block_ids[engine_group.index], dtype=np.int64)
            for member in engine_group.members:
                for chunk in store.needed_chunks(member, num_chunks):
                    first = chunk * self.chunk_size
                    if engine_group.token_indexed and first + self.chunk_size <= plan.local_tokens:
                        continue  # in vLLM's own prefix cache already
                    shared = self.shared_reader is not None and member in self.deployment.shared_groups
                    reader = self.shared_reader if shared and self.shared_reader is not None else bound(self.reader)
                    index, buffer = buffers.take()
                    entry = reader.read((shared_keys if shared else keys)[chunk], member, chunk, buffer)
                    if entry is None:
                        logger.warning("request %s: chunk %d of group %d is gone or corrupt; vLLM recomputes "
                                       "the request's %d tokens", plan.request_id, chunk, member, plan.num_tokens)
                        return False
                    self._write_entry(member, transfers[member], engine_group, entry, first, plan, block_ids)
                    buffers.copied(index, self.load_stream.record())  # the buffer is refilled after this
        return True

    def _write_entry(self, member: int, transfer: KVTransfer, engine_group: EngineGroup, entry: torch.Tensor,
                     first: int, plan: LoadPlan, block_ids: np.ndarray) -> None:
        """Copy one entry (the chunk from token ``first``) into the request's blocks, on the current stream: a state
        into the block vLLM continues the request from, K/V (rows, pages) past vLLM's own prefix-cache hit."""
        if not engine_group.token_indexed:
            block = engine_group.state_block(plan.block_ids[engine_group.index], plan.num_tokens)
            transfer.unpack([entry], state_indices=[block], synchronize=False)
            return
        spec = self.specs[member]
        stored_first = spec.slot_range(first, first + self.chunk_size)[0]
        local_end = spec.slot_range(0, plan.local_tokens)[1] if plan.local_tokens else 0
        slots = chunk_slots(spec, first, first + self.chunk_size, block_ids, engine_group.block_size, local_end)
        rows = np.arange(slots.size) + max(0, local_end - stored_first)  # the entry's rows these slots take
        kept = slots >= 0  # the null block's slots have slid out of the window: nothing to write
        if kept.all() and slots.size == entry.shape[2]:
            transfer.unpack([entry], torch.from_numpy(slots), synchronize=False)
        elif kept.any():
            chosen = entry.index_select(2, torch.from_numpy(rows[kept]))
            transfer.unpack([chosen], torch.from_numpy(slots[kept]), synchronize=False)

    def finished_loads(self, idle: bool = False) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads ended since the last call, and those of them that failed.

        ``idle``: this step computed nothing, so the engine has nothing to do but wait for them: wait
        up to :data:`IDLE_WAIT_SECONDS` for one to end, rather than hand back an empty step at once.
        """
        if self.loads is None:
            return set(), set()
        if idle:
            self.loads.wait_for_one(IDLE_WAIT_SECONDS)
        return self.loads.take()

    def wait_for_loads(self, timeout: float | None = None) -> bool:
        """Wait until no asynchronous load runs (tests, shutdown); whether none does."""
        return self.loads.wait(timeout) if self.loads is not None else True

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves ------------------------------------------------------------------------------
    def save(self, metadata: KVGroupsConnectorMetadata) -> None:
        asleep = not self.transfers and bool(self._registered)  # the caches' memory is not ours to read
        for plan in metadata.saves:
            try:
                if not asleep:
                    self._save(plan)
            except Exception:  # a save that fails costs a later miss, never this request
                logger.exception("request %s: saving chunks %s failed", plan.request_id, list(plan.chunks))
        if metadata.saves and not asleep:
            # vLLM may hand the blocks a save reads to another request at its next step (a finished
            # request's, a window's, a state vLLM moves on from) and the next forward may write them:
            # the engine's stream runs on only after this step's save copies (no thread waits).
            self.save_stream.before_engine(copies := self.save_stream.record())
            self._finishing += [(plan.request_id, copies) for plan in metadata.saves if plan.finishing]
        elif metadata.saves:  # nothing was copied: its blocks are free to go
            self._finishing += [(plan.request_id, DONE) for plan in metadata.saves if plan.finishing]

    def finished_saves(self) -> set[str]:
        """Finished requests whose last saves are copied out of their blocks (vLLM's ``finished_sending``:
        it frees their blocks now), whether those saves succeeded or not."""
        done = {request_id for request_id, copies in self._finishing if copies.query()}
        self._finishing = [(request_id, copies) for request_id, copies in self._finishing if request_id not in done]
        return done

    def _save(self, plan: SavePlan) -> None:
        store = bound(self.store)
        keys = store.keys(plan.tokens, request_salt=plan.request_salt)
        owned = set(self.deployment.owned_groups(self.rank))  # rank 0 alone saves what every rank holds alike
        for chunk in plan.chunks:
            packs = plan.packs(chunk, self.engine_groups, owned, self.chunk_size, self.specs)
            if not packs:
                continue
            # Queued saves hold host memory from a bounded pool, never the engine's device memory.
            buffers = bound(self.host_buffers).take([
                (self.deployment.groups[member].chunk_shape(self.chunk_size), self.deployment.groups[member].dtype)
                for member in packs])
            if buffers is None:
                store.stats.dropped(DROP_NO_BUFFER)
                continue
            tensors = {}
            # After the forward that computed these tokens, on the save stream: the engine thread does not wait.
            with self.save_stream.launching(after_engine=True):
                for (member, how), buffer in zip(packs.items(), buffers, strict=True):
                    staging = None if self.staging is None else [self.staging[member]]
                    tensors[member] = self.transfers[member].pack(out=[buffer], staging=staging, synchronize=False,
                                                                  **how)[0]
                copies = self.save_stream.record()
            # The writer waits for the copies before it encodes the buffers.
            store.save_chunk(keys[chunk], chunk, tensors, release=partial(bound(self.host_buffers).give_back, buffers),
                             ready=copies.synchronize, written=self.reports.written if self.reports else None)

    # --- helpers ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every queued save is written."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        loads, self.loads = self.loads, None
        if loads is not None:
            loads.close()
        shared, self.shared_store = self.shared_store, None
        if shared is not None:
            shared.close()
        store, self.store = self.store, None
        if store is not None:
            store.close()

