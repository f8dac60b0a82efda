"""``KVGroupsConnector``: vLLM's KV connector interface (v1, with the hybrid allocator) on kvgroups.

Enable it with ``KVTransferConfig(kv_connector="KVGroupsConnector",
kv_connector_module_path="kvgroups.integrations.vllm", kv_role="kv_both",
kv_connector_extra_config={"store": URL or [URLs], "chunk_size": N, "salt": S})``. vLLM builds
one instance per role in different processes; each delegates to its side
(:mod:`~kvgroups.integrations.vllm.scheduler_side`, :mod:`~kvgroups.integrations.vllm.worker_side`).
Hits load asynchronously by default (the request waits while other requests run; ``"load_mode":
"sync"`` loads before the forward instead, for models of one KV-cache group), and layer-by-layer
hooks do nothing: every layer, attention or recurrent, is moved at once per request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import vllm
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvgroups.integrations.vllm.backends import check_backends
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata
from kvgroups.integrations.vllm.scheduler_side import SchedulerSide
from kvgroups.integrations.vllm.settings import ConnectorConfigError
from kvgroups.integrations.vllm.stats import KVGroupsConnectorStats, KVGroupsPromMetrics
from kvgroups.integrations.vllm.versions import untested_warning
from kvgroups.integrations.vllm.worker_side import WorkerSide

logger = logging.getLogger(__name__)

# vLLM's prompt_tokens_cached_by_source{source=...} for hits served by each kind of tier.
_HIT_SOURCE_OF_TIER = {"memory": CacheHitSource.HOST, "file": CacheHitSource.DISK}


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: PLC0415 - needs vLLM's groups

    return int(get_tensor_model_parallel_rank())


class KVGroupsConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefix KV of every vLLM KV-cache group (full, sliding, chunked, MLA, mamba) in a kvgroups chunk store.

    vLLM builds it (``kv_connector="KVGroupsConnector"``, ``kv_connector_module_path=
    "kvgroups.integrations.vllm"``) once per role: ``vllm_config.kv_transfer_config.
    kv_connector_extra_config`` holds ``store`` (a URL or a tier list), ``chunk_size`` and ``salt``.

    Raises:
        ConnectorConfigError: the extra config is not what the connector takes.
        UnsupportedCacheError: a cache the connector cannot restore exactly (pipeline or
            decode-context parallelism, unchecked attention backends, quantization with scales
            outside the page, groups excluded from KV transfer), naming the layer and why.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ConnectorConfigError("KVGroupsConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        self.deployment = Deployment(vllm_config, kv_cache_config)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.deployment, kv_cache_config, vllm_config.cache_config)
            self._warn_about_failures(policy)
            untested = untested_warning(vllm.__version__)
            if untested:  # once per engine: the scheduler's connector is the one of its kind
                logger.warning(untested)
        else:
            self._worker = WorkerSide(self.deployment, _tensor_parallel_rank())

    def _warn_about_failures(self, policy: str) -> None:
        deployment = self.deployment
        if deployment.settings.load_mode == "sync" and deployment.load_asynchronously:
            logger.warning("KVGroupsConnector: load_mode 'sync' is not safe for this model (%s), so hits load "
                           "asynchronously", deployment.sync_unsafe)
        if policy != "recompute" and deployment.is_consumer:
            how = ("the request is reported failed" if deployment.load_asynchronously
                   else "its blocks are reported failed")
            logger.warning(
                "KVGroupsConnector: kv_load_failure_policy is %r: a hit whose entries are gone or corrupt when "
                "the worker loads them (evicted or damaged after the lookup) fails its request with an error "
                "(%s). Set kv_load_failure_policy='recompute' to have vLLM recompute it instead.", policy, how)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save that never lands costs a later miss, nothing more

    # --- worker side ------------------------------------------------------------------------
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on the scheduler-side connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker_side()
        check_backends(self.deployment.plan, self._vllm_config.compilation_config.static_forward_context)
        worker.register(kv_caches)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any = None) -> Any:
        """vLLM 0.34: the workers copy into and out of the KV cache with torch ops in their own process (no
        registration with UCX or RDMA, no export to another process): any allocation works."""
        from vllm.config import kv_transfer  # noqa: PLC0415 (KVCacheAccess is vLLM 0.34's; only 0.34 asks)

        return kv_transfer.KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.34: no. With EAGLE's block drop vLLM can hash each block with the tokens after it that its
        drafter's K/V read; a stored chunk's key covers its own tokens only, so a hit could hand the drafter
        K/V computed before other tokens. False keeps vLLM's block hashes to each block's own tokens."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33's sleep mode frees and remaps the caches: the two hooks below follow it."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep (vLLM 0.33): every copy into or out of the caches done, every binding to them dropped."""
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        """After wake-up (vLLM 0.33): the caches bound again, their kernels compiled."""
        if self._worker is not None:
            self._worker.restore()

    def _plans(self) -> KVGroupsConnectorMetadata | None:
        metadata = self._connector_metadata
        return metadata if isinstance(metadata, KVGroupsConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plans = self._plans()
        if plans is not None and plans.loads:
            self._worker_side().load(plans)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv restored every layer already

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # wait_for_save saves every layer, recurrent ones too (they have no such hook)

    def wait_for_save(self) -> None:
        plans = self._plans()
        if plans is not None and plans.saves:
            self._worker_side().save(plans)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        plans = self._plans()
        finished, failed = self._worker.finished_loads(idle=plans is not None and plans.idle)
        # A failed load is reported finished too: vLLM then recomputes the request and frees its blocks.
        return KVConnectorTransferResults(finished_sending=self._worker.finished_saves(), finished_recving=finished,
                                          failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The entries this worker wrote or deleted since the last step, for the scheduler's KV events."""
        reports = self._worker.reports if self._worker is not None else None
        return reports.take() if reports is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    # --- scheduler side ---------------------------------------------------------------------
    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on the worker-side connector")
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34: whether ``request``'s load may start while the running batch is full."""
        return self._scheduler_side().may_load_async(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load writes every group's blocks (states too): vLLM must zero none of them after it.
        return tuple(range(self.deployment.num_engine_groups))

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        self._scheduler_side().update(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What the store came to hold (or lost) since the last call, as vLLM's KV events (docs/vllm.md)."""
        events = self._scheduler.events if self._scheduler is not None else None
        return events.take() if events is not None else ()

    def reset_cache(self) -> bool | None:
        """After a weight update vLLM resets its prefix cache with the connector's: stored chunks are never
        served by this server again (see :meth:`SchedulerSide.reset`)."""
        return self._scheduler.reset() if self._scheduler is not None else None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """A hit's tokens by the tier serving them: memory (host), file (disk), a server (external)."""
        sources: dict[CacheHitSource, int] = {}
        for tier, tokens in self._scheduler_side().hit_sources(request, num_external_tokens).items():
            source = _HIT_SOURCE_OF_TIER.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + tokens
        return sources

    # --- metrics ----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVGroupsConnectorStats | None:
        """This side's store counts since the last call: the scheduler's lookups, a worker's loads and saves."""
        reporter = self._scheduler.stats if self._scheduler is not None else (
            self._worker.stats if self._worker is not None else None)
        data = reporter.take() if reporter is not None else None
        return KVGroupsConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVGroupsConnectorStats:
        return KVGroupsConnectorStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVGroupsPromMetrics:
        return KVGroupsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()


def flush_saves(worker: Any = None) -> bool:
    """Wait until this worker's connector has written every queued save; ``llm.collective_rpc(flush_saves)``.

    Saves leave the request's path through a background writer; an engine that hands the store to
    another one at once (a test, a benchmark, a shutdown script) calls this first. True where this
    process's connector is a ``KVGroupsConnector``. (vLLM sends a function to worker processes only
    with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.)
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group  # noqa: PLC0415 - a worker's

    if not has_kv_transfer_group():
        return False
    connector = get_kv_transfer_group()
    if not isinstance(connector, KVGroupsConnector) or connector._worker is None:
        return False
    connector._worker.flush()
    return True
