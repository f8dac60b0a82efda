"""The connector's saves on the worker: a step's chunks copied out of the caches together, then written.

Saves run in ``wait_for_save``, after the forward that computed them and before vLLM may hand their blocks
to another request. On a GPU they run on the worker's save stream, ordered after the forward by one
``wait_stream`` (no thread waits): every chunk of every request the step completed is queued into host
buffers from a bounded pool, then copied by one launch per group and marked by one event; the chunk store's
writer waits for that event before it encodes the buffers. A save that fails is logged and costs a later
miss, never the request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import torch

from kvgroups.datapath.streams import DONE, Completion, CopyStream
from kvgroups.errors import KVGroupsError
from kvgroups.store.metrics.counters import DROP_NO_BUFFER

if TYPE_CHECKING:
    from kvgroups.core.cache_specs import LayerCacheSpec
    from kvgroups.datapath.buffers import HostBufferPool
    from kvgroups.datapath.descriptors import Launched
    from kvgroups.datapath.transfer import KVTransfer
    from kvgroups.integrations.vllm.deployment import Deployment
    from kvgroups.integrations.vllm.engine_groups import EngineGroup
    from kvgroups.integrations.vllm.events import EntryReports
    from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata, SavePlan
    from kvgroups.store.chunks.chunk_store import KVChunkStore

logger = logging.getLogger("kvgroups.integrations.vllm.worker_side")
Bound = TypeVar("Bound")


def bound(value: Bound | None) -> Bound:
    """What ``register_kv_caches`` sets up, once it has."""
    if value is None:
        raise KVGroupsError("register_kv_caches was not called before the first load or save")
    return value


@dataclass(eq=False)
class _QueuedSave:
    """One chunk's copies queued by a step's save, for the writer once they are launched."""

    key: str
    chunk: int
    buffers: list[torch.Tensor]
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    failed: bool = False


def launch_groups(transfers: list[KVTransfer], stream: CopyStream, *,
                  scatter: bool) -> tuple[Completion, dict[int, Exception]]:
    """Launch every group's queued copies of one direction (inside ``stream.launching()``), then one event: that
    event, and the groups whose launch failed, with the error (their queues dropped, the others launched)."""
    launched: list[Launched] = []
    failed: dict[int, Exception] = {}
    for member, transfer in enumerate(transfers):
        try:
            launched.append(transfer.launch(scatter=scatter))
        except Exception as error:  # whatever the driver raised fails this group's copies alone
            failed[member] = error
    copies = stream.record()
    for each in launched:
        each.release_after(copies)
    return copies, failed


class WorkerSaves:
    """The worker side's saves (a part of :class:`~kvgroups.integrations.vllm.worker_side.WorkerSide`)."""

    deployment: Deployment
    rank: int
    chunk_size: int
    store: KVChunkStore | None
    transfers: list[KVTransfer]
    engine_groups: list[EngineGroup]
    specs: list[LayerCacheSpec]
    save_stream: CopyStream
    staging: list[torch.Tensor | None] | None
    host_buffers: HostBufferPool | None
    reports: EntryReports | None
    _registered: dict[str, torch.Tensor]
    # Finished requests whose last saves copy out of their blocks: vLLM frees those once reported.
    _finishing: list[tuple[str, Completion]]
    # Host buffers of saves that failed once queued: given back once their step's copies completed.
    _held: list[tuple[list[torch.Tensor], Completion]]

    # --- saves ------------------------------------------------------------------------------
    def save(self, metadata: KVGroupsConnectorMetadata) -> None:
        """Copy every chunk this step completed out of the caches, then hand them to the writer.

        On the save stream, ordered after the step's forward by one ``wait_stream``: every chunk of every
        request queued first, then one launch per group and one event for the step."""
        asleep = not self.transfers and bool(self._registered)  # the caches' memory is not ours to read
        if not metadata.saves:
            return
        if asleep:  # nothing was copied: its blocks are free to go
            self._finishing += [(plan.request_id, DONE) for plan in metadata.saves if plan.finishing]
            return
        self._release_held()
        queued: list[_QueuedSave] = []
        with self.save_stream.launching(after_engine=True):
            for plan in metadata.saves:
                try:
                    self._queue_saves(plan, queued)
                except Exception:  # a save that fails costs a later miss, never this request
                    logger.exception("request %s: saving chunks %s failed", plan.request_id, list(plan.chunks))
            copies, unlaunched = launch_groups(self.transfers, self.save_stream, scatter=False)
        for member, error in unlaunched.items():  # a copy that cannot be launched fails its saves, never the engine
            logger.error("saving %d chunks: group %d's copies could not be launched", len(queued), member,
                         exc_info=error)
        store = bound(self.store)
        for save in queued:
            # A save that failed, or lost a group's copies: its buffers may still be written by this step's copies.
            if save.failed or unlaunched.keys() & save.tensors.keys():
                self._held.append((save.buffers, copies))
                continue
            # The writer waits for the copies before it encodes the buffers.
            store.save_chunk(save.key, save.chunk, save.tensors,
                             release=partial(bound(self.host_buffers).give_back, save.buffers),
                             ready=copies.synchronize, written=self.reports.written if self.reports else None)
        # vLLM may hand the blocks a save reads to another request at its next step (a finished
        # request's, a window's, a state vLLM moves on from) and the next forward may write them:
        # the engine's stream runs on only after this step's save copies (no thread waits).
        self.save_stream.before_engine(copies)
        self._finishing += [(plan.request_id, copies) for plan in metadata.saves if plan.finishing]

    def finished_saves(self) -> set[str]:
        """Finished requests whose last saves are copied out of their blocks (vLLM's ``finished_sending``:
        it frees their blocks now), whether those saves succeeded or not."""
        done = {request_id for request_id, copies in self._finishing if copies.query()}
        self._finishing = [(request_id, copies) for request_id, copies in self._finishing if request_id not in done]
        return done

    def _queue_saves(self, plan: SavePlan, queued: list[_QueuedSave]) -> None:
        """Queue the copies of ``plan``'s chunks into host buffers (launched with the step's other saves)."""
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
            save = _QueuedSave(keys[chunk], chunk, buffers)
            queued.append(save)
            try:
                for (member, how), buffer in zip(packs.items(), buffers, strict=True):
                    buffer_on_device = None if self.staging is None else self.staging[member]
                    staging = None if buffer_on_device is None else [buffer_on_device]
                    save.tensors[member] = self.transfers[member].pack(out=[buffer], staging=staging, defer=True,
                                                                       synchronize=False, **how)[0]
            except Exception:
                save.failed = True
                raise

    def _release_held(self) -> None:
        """Give back the buffers of failed saves whose step's copies completed."""
        done = [buffers for buffers, copies in self._held if copies.query()]
        self._held = [(buffers, copies) for buffers, copies in self._held if not copies.query()]
        for buffers in done:
            bound(self.host_buffers).give_back(buffers)

