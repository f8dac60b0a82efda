"""The connector's worker side: bind vLLM's registered caches, restore planned prefixes, save new chunks.

Loads run in ``start_load_kv``, before the forward that needs them; saves in ``wait_for_save``,
after the forward that computed them and before vLLM may hand their blocks to another request.
The copies are the data path's (``KVTransfer``, one per kvgroups group, bound once); encoding
and writing happen on the chunk store's background writer. A load that fails reports its blocks
to vLLM (``get_block_ids_with_load_errors``), which recomputes them under
``kv_load_failure_policy="recompute"``; a save that fails is logged and costs a later miss.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from kvgroups.core.sizes import ceil_div
from kvgroups.datapath.buffers import HostBufferPool
from kvgroups.datapath.kernels import warm_up
from kvgroups.datapath.slots import paged_slots
from kvgroups.datapath.transfer import KVTransfer
from kvgroups.errors import KVGroupsError
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata, LoadPlan, SavePlan
from kvgroups.store.chunk_store import KVChunkStore

logger = logging.getLogger(__name__)

class WorkerSide:
    """One worker's caches bound to its rank's chunk store."""

    def __init__(self, deployment: Deployment, rank: int) -> None:
        self.deployment = deployment
        self.rank = rank
        self.chunk_size = deployment.settings.chunk_size
        self.expected = deployment.metadata(rank, deployment.groups, "worker").fingerprint()
        self.store: KVChunkStore | None = None
        self.transfers: list[KVTransfer] = []
        self.engine_groups = deployment.engine_groups
        self._load_errors: set[int] = set()

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
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
        settings = self.deployment.settings
        self.store = KVChunkStore(metadata, list(settings.stores), salt=settings.salt, secret=settings.secret,
                                  encrypt=settings.encrypt, max_pending_bytes=settings.max_pending_bytes)
        device = self.transfers[0].device if self.transfers else torch.device("cpu")
        self.host_buffers = HostBufferPool(settings.max_pending_bytes, pin=device.type != "cpu")
        # Saves queued when the process exits are written first, whether or not vLLM shuts us down.
        atexit.register(self.close)
        kernel = warm_up(self.transfers[0].device) if self.transfers else "none"
        logger.info("KVGroupsConnector rank %d: %d groups (%s), kernels %s, store %s", self.rank, len(groups),
                    ", ".join(f"{group.kind.value} x{len(group.layer_names)}" for group in groups), kernel,
                    self.store.store.url)

    # --- loads ------------------------------------------------------------------------------
    def load(self, metadata: KVGroupsConnectorMetadata) -> None:
        for plan in metadata.loads:
            try:
                loaded = self._load(plan)
            except Exception:  # a load must never take the engine down: vLLM recomputes what failed
                logger.exception("request %s: restoring %d tokens failed", plan.request_id, plan.num_tokens)
                loaded = False
            if not loaded:
                self._load_errors.update(self._planned_blocks(plan))

    def _load(self, plan: LoadPlan) -> bool:
        store = self._bound_store()
        keys = store.keys(plan.tokens, request_salt=plan.request_salt)
        prefix = store.load(None, plan.num_tokens, keys=keys)
        if prefix.num_tokens != plan.num_tokens:
            logger.warning("request %s: the store served %d of the %d tokens promised; vLLM recomputes the rest",
                           plan.request_id, prefix.num_tokens, plan.num_tokens)
            return False
        for engine_group in self.engine_groups:
            block_ids = np.asarray(plan.block_ids[engine_group.index], dtype=np.int64)
            for member in engine_group.members:
                part = prefix.groups[member]
                transfer = self.transfers[member]
                if not engine_group.token_indexed:
                    transfer.unpack([part.tensor], state_indices=[self._state_block(block_ids)])
                    continue
                positions = np.arange(max(part.first_token, plan.local_tokens), plan.num_tokens)
                slots = paged_slots(positions, block_ids, engine_group.block_size)
                # Tokens whose block is the null block have slid out of the window: nothing to write.
                kept = slots >= 0
                transfer.unpack([part.rows(positions[kept])], torch.from_numpy(slots[kept]))
        return True

    def _planned_blocks(self, plan: LoadPlan) -> set[int]:
        """The blocks a failed load leaves undefined: every group's blocks past the local hit."""
        blocks: set[int] = set()
        for engine_group in self.engine_groups:
            ids = plan.block_ids[engine_group.index]
            if engine_group.token_indexed:
                first = plan.local_tokens // engine_group.block_size
                last = ceil_div(plan.num_tokens, engine_group.block_size)
                blocks.update(ids[first:last])
            else:
                blocks.update(ids[:1])
        blocks.discard(0)
        return blocks

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves ------------------------------------------------------------------------------
    def save(self, metadata: KVGroupsConnectorMetadata) -> None:
        for plan in metadata.saves:
            try:
                self._save(plan)
            except Exception:  # a save that fails costs a later miss, never this request
                logger.exception("request %s: saving chunks %s failed", plan.request_id, list(plan.chunks))

    def _save(self, plan: SavePlan) -> None:
        store = self._bound_store()
        keys = store.keys(plan.tokens, request_salt=plan.request_salt)
        block_ids_of = {engine_group.index: np.asarray(plan.block_ids[engine_group.index], dtype=np.int64)
                        for engine_group in self.engine_groups}
        for chunk in plan.chunks:
            positions = np.arange(chunk * self.chunk_size, (chunk + 1) * self.chunk_size)
            packs: dict[int, dict[str, Any]] = {}  # group -> how to pack it
            for engine_group in self.engine_groups:
                block_ids = block_ids_of[engine_group.index]
                if engine_group.token_indexed:
                    slots = paged_slots(positions, block_ids, engine_group.block_size)
                    if (slots < 0).any():
                        continue  # part of the chunk has left this group's blocks (a window moved on)
                    packs.update({member: {"slot_mapping": torch.from_numpy(slots)} for member in engine_group.members})
                elif plan.step_end == (chunk + 1) * self.chunk_size and engine_group.state_mode == "none":
                    state = self._state_block(block_ids)
                    packs.update({member: {"state_indices": [state]} for member in engine_group.members})
            if not packs:
                continue
            # Queued saves hold host memory from a bounded pool, never the engine's device memory.
            buffers = self.host_buffers.take([
                (self.deployment.groups[member].chunk_shape(self.chunk_size), self.deployment.groups[member].dtype)
                for member in packs])
            if buffers is None:
                store.stats.dropped("no_buffer")
                continue
            tensors = {}
            for (member, how), buffer in zip(packs.items(), buffers, strict=True):
                tensors[member] = self.transfers[member].pack(out=[buffer], **how)[0]
            store.save_chunk(keys[chunk], chunk, tensors, release=partial(self.host_buffers.give_back, buffers))

    # --- helpers ----------------------------------------------------------------------------
    def _bound_store(self) -> KVChunkStore:
        if self.store is None:
            raise KVGroupsError("register_kv_caches was not called before the first load or save")
        return self.store

    @staticmethod
    def _state_block(block_ids: np.ndarray) -> int:
        if block_ids.size != 1 or block_ids[0] == 0:
            raise KVGroupsError(f"a recurrent group's blocks are {block_ids.tolist()}; expected its one state block")
        return int(block_ids[0])

    def flush(self) -> None:
        """Wait until every queued save is written."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()

