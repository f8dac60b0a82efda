"""The connector's worker side: bind vLLM's registered caches, restore planned prefixes, save new chunks.

A load reads each entry once, into one of the loading thread's reused buffers (as many at once as its free
buffers hold, one batch of the store: :mod:`~kvgroups.integrations.vllm.entry_windows`), checks it, and queues
its copy into the request's blocks (``KVTransfer.unpack(defer=True)``); the queued copies go in one launch per
group once the buffers are full or the loads are read. Entries below vLLM's own prefix-cache hit are not read.
Asynchronous loads run in background threads (:mod:`~kvgroups.integrations.vllm.loads`) while the engine runs
other requests, reported through ``get_transfer_results``: a failed one in ``failed_recving``, so that vLLM
recomputes the request under ``kv_load_failure_policy="recompute"``. Synchronous loads (all of a step's
together) run in ``start_load_kv``, before the forward that needs them; a failed one reports its blocks
(``get_block_ids_with_load_errors``), which vLLM recomputes. Saves:
:mod:`~kvgroups.integrations.vllm.worker_saves`.

On a GPU the worker copies as vLLM's own offloading does (:mod:`~kvgroups.datapath.streams`): loads
on a stream of their own and saves on another, launched with the caches' device current in the
launching thread, one event per launch; a load is reported only once its event completed, and its
buffers are refilled only then. Every kernel is compiled at registration; the Triton kernels read the
pinned read buffers and write the pinned save buffers themselves (a staging buffer per group, allocated
and logged at registration, serves the groups the torch path copies).
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Mapping
from functools import partial

import numpy as np
import torch

from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.datapath.buffers import HostBufferPool, ReadBuffers
from kvgroups.datapath.kernels import warm_up
from kvgroups.datapath.streams import Completion, CopyStream
from kvgroups.datapath.transfer import KVTransfer
from kvgroups.errors import KVGroupsError
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.engine_groups import EngineGroup
from kvgroups.integrations.vllm.entry_windows import NeededEntry, read_window
from kvgroups.integrations.vllm.events import EntryReports, ReportingChunkStore
from kvgroups.integrations.vllm.loads import BackgroundLoads
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata, LoadPlan, chunk_slots
from kvgroups.integrations.vllm.stats import StatsReporter
from kvgroups.integrations.vllm.worker_saves import WorkerSaves, bound, launch_groups
from kvgroups.store.chunks.chunk_store import KVChunkStore
from kvgroups.store.chunks.entry_reads import EntryReader

logger = logging.getLogger(__name__)

# How long a step that computed nothing waits for an asynchronous load to end (the engine's next step
# starts at once when one does); bounded, so that new requests are admitted as before.
IDLE_WAIT_SECONDS = 0.05
# Host memory one loading thread reads entries into (pinned on a GPU): a step's entries are copied together
# while they fit, in as many launches as it takes otherwise.
READ_BUFFER_BYTES = 64 << 20
MAX_READ_BUFFERS = 64

class _LaunchFailedError(RuntimeError):
    """Copies of a load could not be launched; ``copies`` ends those that were."""

    def __init__(self, copies: Completion, message: str) -> None:
        super().__init__(f"copies could not be launched ({message})")
        self.copies = copies


class WorkerSide(WorkerSaves):
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
        self.staging: list[torch.Tensor | None] | None = None  # per group, where a save gathers on a GPU
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
        # Host buffers of saves that failed once queued: given back once their step's copies completed.
        self._held: list[tuple[list[torch.Tensor], Completion]] = []

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
            # The device memory saves take beyond vLLM's budget: one chunk per group, reused by every save,
            # for the groups whose kernel cannot write pinned host memory itself (the torch path).
            self.staging = [None if transfer.addresses_pinned_chunks else
                            torch.empty(group.chunk_bytes(self.chunk_size), dtype=torch.uint8, device=device)
                            for group, transfer in zip(groups, self.transfers, strict=True)]
            staging_bytes = sum(buffer.numel() for buffer in self.staging if buffer is not None)
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
        """Start this step's asynchronous loads; run its synchronous ones (before the forward), every entry of
        them read first, then copied by one launch per group (as many as the read buffers hold)."""
        if not self.transfers and self._registered:  # asleep (vLLM drains requests first): nothing to write into
            logger.warning("KVGroupsConnector rank %d: %d loads while the caches are unregistered fail",
                           self.rank, len(metadata.loads))
        synchronous = []
        for plan in metadata.loads:
            if plan.asynchronous:
                # Beside a forward a load copies on one thread; in a step that computes nothing (every
                # request waits) on all of them.
                transfers = self.transfers if metadata.idle else self.load_transfers
                bound(self.loads).submit(plan.request_id, partial(self._launch_one, plan, transfers))
            else:
                synchronous.append(plan)
        if not synchronous:
            return
        if self._sync_buffers is None:
            self._sync_buffers = self._read_buffers()
        loaded, copies = self._launch(synchronous, self.transfers, self._sync_buffers)
        # The forward that reads these blocks runs after the copies, on the GPU; nothing waits here.
        self.load_stream.before_engine(copies)
        for plan in synchronous:
            if plan.request_id not in loaded:
                self._load_errors.update(plan.blocks_written(self.engine_groups))

    def _read_buffers(self) -> ReadBuffers:
        """Where one loading thread reads entries: pinned on a GPU, each refilled once copied from; as many as
        :data:`READ_BUFFER_BYTES` hold (two at least), so that a step's entries are copied by few launches."""
        size = bound(self.reader).buffer_size()
        return ReadBuffers(size, pin=self.device.type == "cuda", count=max(2, min(MAX_READ_BUFFERS,
                                                                                  READ_BUFFER_BYTES // max(size, 1))))

    def _launch(self, plans: list[LoadPlan], transfers: list[KVTransfer],
                buffers: ReadBuffers) -> tuple[set[str], Completion]:
        """Restore ``plans`` on the load stream: the requests whose every entry was there and copied, and the end
        of the copies (also of a failed load's, which may have written some blocks before it failed). A launch
        that fails fails every plan of the call (which of them it held is not known)."""
        loaded = set()
        launches_failed = False
        with self.load_stream.launching():
            for plan in plans:
                try:
                    if self._restore(plan, transfers, buffers):
                        loaded.add(plan.request_id)
                except Exception as error:  # a load must never take the engine down: vLLM recomputes what failed
                    launches_failed |= isinstance(error, _LaunchFailedError)
                    logger.exception("request %s: restoring %d tokens failed", plan.request_id, plan.num_tokens)
            try:
                copies = self._launch_queued(transfers, buffers)
            except _LaunchFailedError as error:
                logger.error("restoring %d requests failed: %s", len(plans), error)
                copies, launches_failed = error.copies, True
        return (set() if launches_failed else loaded), copies

    def _launch_one(self, plan: LoadPlan, transfers: list[KVTransfer], buffers: ReadBuffers) -> tuple[bool, Completion]:
        """An asynchronous load's job: whether ``plan`` was restored whole, and the end of its copies."""
        loaded, copies = self._launch([plan], transfers, buffers)
        return plan.request_id in loaded, copies

    def _launch_queued(self, transfers: list[KVTransfer], buffers: ReadBuffers) -> Completion:
        """Copy every entry queued out of ``buffers``: one launch per group, one event; raises
        :class:`_LaunchFailedError` (after every group's queue is launched or dropped) when one failed."""
        copies, failed = launch_groups(transfers, self.load_stream, scatter=True)
        buffers.launched(copies)
        if failed:
            raise _LaunchFailedError(copies, "; ".join(f"group {member}: {type(error).__name__}: {error}"
                                                       for member, error in failed.items()))
        return copies

    def _restore(self, plan: LoadPlan, transfers: list[KVTransfer], buffers: ReadBuffers) -> bool:
        """Read every entry the plan needs, once, and queue its copy into the request's blocks; whether all were
        there. Counted as one load of the tokens it restored beyond vLLM's own prefix-cache hit (none when it
        failed)."""
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
        needed = [
            NeededEntry(engine_group, np.asarray(plan.block_ids[engine_group.index], dtype=np.int64), member, chunk,
                        chunk * self.chunk_size,
                        self.shared_reader is not None and member in self.deployment.shared_groups)
            for engine_group in self.engine_groups for member in engine_group.members
            for chunk in store.needed_chunks(member, num_chunks)
            # K/V in vLLM's own prefix cache already are not read.
            if not (engine_group.token_indexed and (chunk + 1) * self.chunk_size <= plan.local_tokens)]
        position = 0
        while position < len(needed):
            if buffers.all_queued():  # every buffer holds an entry not yet copied: copy them now
                self._launch_queued(transfers, buffers)
            taken = buffers.take_free(len(needed) - position)
            window = needed[position:position + len(taken)]
            position += len(taken)
            entries = read_window(window, [buffer for _, buffer in taken], keys, shared_keys, bound(self.reader),
                                  self.shared_reader)
            for item, (index, _), entry in zip(window, taken, entries, strict=True):
                if entry is None:
                    logger.warning("request %s: chunk %d of group %d is gone or corrupt; vLLM recomputes the "
                                   "request's %d tokens", plan.request_id, item.chunk, item.member, plan.num_tokens)
                    return False
                self._write_entry(item.member, transfers[item.member], item.engine_group, entry, item.first, plan,
                                  item.block_ids)
                buffers.queued(index)  # refilled once the launch that copies it completed
        return True

    def _write_entry(self, member: int, transfer: KVTransfer, engine_group: EngineGroup, entry: torch.Tensor,
                     first: int, plan: LoadPlan, block_ids: np.ndarray) -> None:
        """Queue the copy of one entry (the chunk from token ``first``) into the request's blocks: a state into
        the block vLLM continues the request from, K/V (rows, pages) past vLLM's own prefix-cache hit."""
        if not engine_group.token_indexed:
            block = engine_group.state_block(plan.block_ids[engine_group.index], plan.num_tokens)
            transfer.unpack([entry], state_indices=np.array([block], dtype=np.int64), defer=True)
            return
        spec = self.specs[member]
        stored_first = spec.slot_range(first, first + self.chunk_size)[0]
        local_end = spec.slot_range(0, plan.local_tokens)[1] if plan.local_tokens else 0
        slots = chunk_slots(spec, first, first + self.chunk_size, block_ids, engine_group.block_size, local_end)
        kept = slots >= 0  # the null block's slots have slid out of the window: nothing to write
        if kept.all() and slots.size == entry.shape[2]:
            transfer.unpack([entry], slots, defer=True)
        elif kept.any():
            rows = np.arange(slots.size, dtype=np.int64) + max(0, local_end - stored_first)  # the entry's rows
            transfer.unpack([entry], slots[kept], rows=rows[kept], defer=True)

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

