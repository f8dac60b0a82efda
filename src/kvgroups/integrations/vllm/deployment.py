"""One vLLM deployment as the connector sees it, the same on the scheduler and on every worker.

Settings, the engine plan (groups per vLLM KV-cache group), the model's identity, and per
tensor-parallel rank the ``LMCacheMetadata`` whose fingerprint names that rank's chunks. Both
sides build it from the same ``VllmConfig`` and ``KVCacheConfig``, so their keys agree.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms import current_platform

from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.layouts import KVLayout
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.errors import UnsupportedCacheError
from kvgroups.integrations.vllm.engine_groups import STATE_MODES, EnginePlan, engine_layout
from kvgroups.integrations.vllm.settings import ConnectorSettings, model_identity


class Deployment:
    """Settings, plan and identity of one deployment; :meth:`metadata` per rank."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, layout: KVLayout | None = None) -> None:
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        unsupported = {
            "pipeline_parallel_size": parallel.pipeline_parallel_size,
            "decode_context_parallel_size": getattr(parallel, "decode_context_parallel_size", 1),
        }
        if any(size != 1 for size in unsupported.values()):
            raise UnsupportedCacheError(f"KVGroupsConnector stores tensor-parallel ranks only; got {unsupported}")
        self.world_size = int(parallel.tensor_parallel_size)
        # The platform decides the layout; tests of the other platform's layout pass it.
        self.plan = EnginePlan(kv_cache_config, layout or engine_layout(current_platform.is_cpu()), vllm_config)
        # A hit ends on a chunk boundary, where every group must be able to hold it: attention groups
        # in whole blocks, recurrent groups on vLLM's block grid ("align") at one of its boundaries.
        on_grid = [group for group in self.plan.engine_groups if group.states_on_block_grid]
        self.settings = self.settings.for_blocks(
            {group.index: group.block_size for group in self.plan.engine_groups
             if group.token_indexed or group.states_on_block_grid},
            states_on_block_grid=bool(on_grid))
        # Where vLLM keeps states on its grid, a chunk longer than one grid step has a state only where a
        # prefill step happened to end on its boundary (the scheduler warns).
        self.sparse_states = bool(on_grid) and any(self.settings.chunk_size > group.block_size for group in on_grid)
        self.identity = model_identity(vllm_config)
        self.engine_id = transfer.engine_id
        # The groups every rank must register (the worker checks), and each vLLM group's members among them.
        self.groups, self.engine_groups = self.plan.build_groups(self.plan.meta_values(int(kv_cache_config.num_blocks)))
        # Groups whose bytes are the same on every rank (MLA latents, a sparse indexer's keys: vLLM
        # replicates them): stored once, by rank 0 under its keys, and read from there by every rank.
        self.shared_groups = frozenset(index for index, group in enumerate(self.groups) if group.layout is KVLayout.MLA)
        # vLLM recomputes a failed synchronous load block by block: it refuses (raises) for a model of
        # several KV-cache groups, whose block ids are per group, and for states on its grid it would
        # resume one block before the failed state, from a state it does not hold. Such models load
        # asynchronously, whose failures are per request (recomputed from the start).
        self.num_engine_groups = len(kv_cache_config.kv_cache_groups)
        self.sync_unsafe = (
            f"vLLM cannot recompute a failed synchronous load of {self.num_engine_groups} KV-cache groups (it raises)"
            if self.num_engine_groups > 1 else
            "vLLM would recompute a failed synchronous load from the block before the state, which it does not hold"
            if on_grid else None)
        self.load_asynchronously = self.settings.load_mode == "async" or self.sync_unsafe is not None
        # vLLM publishes KV events (--kv-events-config): the connector adds what the store holds.
        self.kv_events = bool(getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False))
        self.is_producer = bool(transfer.is_kv_producer)
        self.is_consumer = bool(transfer.is_kv_consumer)
        # A recurrent group is served where the connector knows which block vLLM reads its state from
        # (EngineGroup.state_block); a mode of a later vLLM is saved but never served.
        modes = {group.state_mode for group in self.plan.engine_groups if not group.token_indexed}
        unknown = sorted(mode or "" for mode in modes - set(STATE_MODES))
        self.unservable = (
            f"recurrent state kept in mamba_cache_mode {unknown}; the connector restores states in "
            f"mamba_cache_mode {' and '.join(map(repr, STATE_MODES))}" if unknown else None
        )

    def owned_groups(self, rank: int) -> list[int]:
        """The groups rank ``rank`` saves, and whose entries are found under its keys."""
        return [index for index in range(len(self.groups)) if rank == 0 or index not in self.shared_groups]

    def metadata(self, rank: int, groups: list[KVLayerGroupInfo], role: str) -> LMCacheMetadata:
        """The metadata of rank ``rank`` with ``groups`` (from :attr:`groups`, or from registered tensors)."""
        return LMCacheMetadata.for_groups(groups, model_name=self.identity, chunk_size=self.settings.chunk_size,
                                          world_size=self.world_size, worker_id=rank, role=role,
                                          engine_id=self.engine_id)
