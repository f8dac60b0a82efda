"""What the scheduler side tells the workers each step: which requests to load, which chunks to save.

The plans travel inside vLLM's ``SchedulerOutput`` to every worker; each worker computes its own
rank's keys from the tokens, so a plan carries tokens (as little-endian uint32 bytes,
:func:`token_bytes`) and the request's salt (:func:`request_salt`), never keys. Block ids are
vLLM's, one list per KV-cache group, as of this step.
"""

from __future__ import annotations

import json
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.sizes import ceil_div
from kvgroups.datapath.slots import paged_slots
from kvgroups.errors import KVGroupsError
from kvgroups.integrations.vllm.engine_groups import STATE_MODES, EngineGroup


@dataclass(frozen=True)
class LoadPlan:
    """Restore a request's first ``num_tokens`` tokens from the store before its first forward.

    ``local_tokens`` of them are already in vLLM's own prefix cache (their blocks may be shared
    with other requests and are left alone); the rest are written into ``block_ids``.
    ``asynchronous``: the request waits (vLLM's ``WAITING_FOR_REMOTE_KVS``) while the worker
    loads in the background and reports it done; else the load runs before this step's forward.
    """

    request_id: str
    token_bytes: bytes  # the first num_tokens prompt tokens, uint32 little-endian
    request_salt: str
    num_tokens: int
    local_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    asynchronous: bool = False

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.token_bytes, dtype="<u4")

    def blocks_written(self, engine_groups: Sequence[EngineGroup]) -> set[int]:
        """The blocks this load writes (those a failed one leaves undefined): every attention group's past the
        local hit, every recurrent group's state block."""
        blocks: set[int] = set()
        for engine_group in engine_groups:
            ids = self.block_ids[engine_group.index]
            if engine_group.token_indexed:
                first = self.local_tokens // engine_group.block_size
                blocks.update(ids[first:ceil_div(self.num_tokens, engine_group.block_size)])
                continue
            try:
                blocks.add(engine_group.state_block(ids, self.num_tokens))
            except KVGroupsError:  # the load failed on it too: every state block is suspect
                blocks.update(ids)
        blocks.discard(0)
        return blocks


# A SavePlan's step_end where no running state may be read: a finished request's (vLLM may have released its block).
NO_RUNNING_STATE = -1


@dataclass(frozen=True)
class SavePlan:
    """Save chunks ``chunks`` of a request, completed by this step, which computed tokens up to ``step_end``.

    A group's entry is saved only if all of the chunk is in its blocks now (a sliding window
    may have dropped the start of a chunk that began in an earlier step), a recurrent group's
    only where its state at the chunk's end is in a block now: a block vLLM handed over for that
    boundary (``boundary_states``: vLLM's ``boundary_state_offloads`` in ``mamba_cache_mode``
    "align", such as a state a forward exported inside its step), or the block of this step's
    running state where the step ends exactly at the chunk's end (``step_end``; :data:`NO_RUNNING_STATE`
    for a finished request's last saves). ``finishing``: the request finished; the worker reports it
    (``finished_sending``) once these copies are done, and vLLM frees its blocks then.
    """

    request_id: str
    token_bytes: bytes  # the request's tokens through the last chunk saved, uint32 little-endian
    request_salt: str
    chunks: tuple[int, ...]
    step_end: int
    block_ids: tuple[tuple[int, ...], ...]
    # (vLLM group index, tokens, block id): the state after that many tokens is in that block.
    boundary_states: tuple[tuple[int, int, int], ...] = ()
    finishing: bool = False

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.token_bytes, dtype="<u4")

    def packs(self, chunk: int, engine_groups: Sequence[EngineGroup], owned: Container[int],
              chunk_size: int, specs: Sequence[LayerCacheSpec]) -> dict[int, dict[str, Any]]:
        """How to pack chunk ``chunk`` of each kvgroups group among ``owned`` (``specs``: each group's kind): the
        slots it stores (its tokens; compressed rows or pages by their kind), or its state block; groups that
        cannot save it now (above) are left out."""
        end = (chunk + 1) * chunk_size
        handed = {(group, tokens): block for group, tokens, block in self.boundary_states}
        packs: dict[int, dict[str, Any]] = {}
        for engine_group in engine_groups:
            block_ids = np.asarray(self.block_ids[engine_group.index], dtype=np.int64)
            if engine_group.token_indexed:
                for member in (member for member in engine_group.members if member in owned):
                    slots = chunk_slots(specs[member], chunk * chunk_size, end, block_ids, engine_group.block_size)
                    if not (slots < 0).any():  # else part of it has left this group's blocks (a window moved on)
                        packs[member] = {"slot_mapping": slots}
                continue
            how: dict[str, Any]
            if (engine_group.index, end) in handed:
                how = {"state_indices": np.array([handed[engine_group.index, end]], dtype=np.int64)}
            elif self._state_at(engine_group, end):
                how = {"state_indices": np.array([engine_group.state_block(self.block_ids[engine_group.index], end)],
                                                dtype=np.int64)}
            else:
                continue
            packs.update({member: how for member in engine_group.members if member in owned})
        return packs

    def _state_at(self, engine_group: EngineGroup, end: int) -> bool:
        """Whether this step's running state of ``engine_group`` is the state after ``end`` tokens."""
        return self.step_end == end and engine_group.state_mode in STATE_MODES

    def _state_kept(self, engine_group: EngineGroup, end: int) -> bool:
        """Whether ``engine_group``'s state after ``end`` tokens is in a block now: one vLLM handed over for
        that boundary, or this step's running state."""
        return any(group == engine_group.index and tokens == end for group, tokens, _ in self.boundary_states) \
            or self._state_at(engine_group, end)

    def hit_ends(self, engine_groups: Sequence[EngineGroup], chunk_size: int) -> tuple[int, ...]:
        """This plan's chunks at whose end every recurrent group's state is saved (all of them for a model
        without one): where a hit on what it stores may end."""
        return tuple(chunk for chunk in self.chunks if all(
            self._state_kept(group, (chunk + 1) * chunk_size) for group in engine_groups if not group.token_indexed))

    def stores_no_state(self, engine_groups: Sequence[EngineGroup], chunk_size: int) -> bool:
        """Whether some recurrent group has its state at the end of none of this plan's chunks: no chunk these
        saves store can end a hit (vLLM ended this step, and handed over a state, off every chunk's end)."""
        return any(not any(self._state_kept(group, (chunk + 1) * chunk_size) for chunk in self.chunks)
                   for group in engine_groups if not group.token_indexed)


def chunk_slots(spec: LayerCacheSpec, start: int, end: int, block_ids: np.ndarray, block_size: int,
                first_new: int = 0) -> np.ndarray:
    """The cache slots of what a kvgroups group of kind ``spec`` stores of tokens ``[start, end)`` (its tokens,
    compressed rows or pages, ``spec.slot_range``), from slot ``first_new`` on, in blocks ``block_ids`` of
    ``block_size`` tokens; -1 where no block holds one."""
    first, last = spec.slot_range(start, end)
    return paged_slots(np.arange(max(first, first_new), last), block_ids, spec.chunk_slots(block_size))


@dataclass
class KVGroupsConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    idle: bool = False  # the step computes nothing (every request waits, for a load or a lookup)


def request_salt(request: Any) -> str | None:
    """What, besides its tokens, decides a request's KV: cache salt, LoRA adapter, multimodal inputs.

    None for a request whose tokens do not say what it computes (prompt embeddings).
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    parts: dict[str, Any] = {}
    if getattr(request, "cache_salt", None):
        parts["cache_salt"] = request.cache_salt
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts["lora"] = [getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)]
    features = getattr(request, "mm_features", None) or []
    if features:
        parts["mm"] = [[feature.identifier, feature.mm_position.offset, feature.mm_position.length]
                       for feature in features]
    return json.dumps(parts, sort_keys=True) if parts else ""


def token_bytes(token_ids: Any) -> bytes:
    """Token ids as little-endian uint32 bytes, the form plans carry them in."""
    return np.asarray(token_ids, dtype="<u4").tobytes()
