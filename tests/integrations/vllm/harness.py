"""vLLM's real Scheduler driven in-process with a hand-built KV-cache config, and fake worker caches.

The scheduler side of ``KVGroupsConnector`` runs inside vLLM's ``Scheduler`` exactly as in an
engine; the worker side is a ``WorkerSide`` bound to tensors laid out as vLLM allocates them:
one int8 buffer, every group's layers overlaid on the same bytes (a block id belongs to one
group at a time), each layer a ``[num_blocks, num_heads, block_size, 2 * head_size]`` view.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.platforms import current_platform
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvgroups.core.layouts import KVLayout
from kvgroups.integrations.vllm.connector import KVGroupsConnector
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.engine_groups import engine_layout
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata
from kvgroups.integrations.vllm.stats import KVGroupsConnectorStats
from kvgroups.integrations.vllm.worker_side import WorkerSide

HEADS, HEAD_SIZE, DTYPE = 2, 32, torch.float32
# The layout the scheduler side's Deployment picks from vLLM's platform (vLLM builds that side itself):
# the CPU build's pages here; the GPU backends' under vLLM's CUDA wheel, whose platform on a CPU machine
# is "unspecified". Fake workers use the same one, unless a test sets both.
ENGINE_LAYOUT = engine_layout(current_platform.is_cpu())
# Keys and values of their own head sizes (vLLM's diff-KV pages, MiMo-V2's 192 / 128), as large as a K/V page.
DIFF_KEYS, DIFF_VALUES = 40, 24
MLA_HEAD_SIZE = HEADS * 2 * HEAD_SIZE  # one latent row per token, as large as a token's K and V rows
STATE_SHAPES = ((3, 16), (2, 8, 8))  # a conv and an SSM state, per sequence
MAX_MODEL_LEN = 1024
CHUNK = 32  # tokens per stored chunk in these tests


def group_specs(kinds: list[str], block_size: int, window: int, mamba_mode: str = "none",
                spec_blocks: int = 0) -> list[KVCacheGroupSpec]:
    """One vLLM group of two layers per kind ("sliding", "full", "diffkv_sliding", "diffkv_full", "mla", "mamba",
    "mamba2"), layer names interleaved; ``spec_blocks``: a recurrent group's state blocks for draft tokens."""
    attention: dict[str, Any] = dict(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    diff_kv = {**attention, "head_size": DIFF_KEYS, "head_size_v": DIFF_VALUES}
    page_bytes = HEADS * block_size * 2 * HEAD_SIZE * DTYPE.itemsize
    groups = []
    for position, kind in enumerate(kinds):
        names = [f"model.layers.{position + len(kinds) * slot}.attn" for slot in range(2)]
        if kind == "sliding":
            spec: Any = SlidingWindowSpec(sliding_window=window, **attention)
        elif kind == "full":
            spec = FullAttentionSpec(**attention)
        elif kind == "diffkv_sliding":
            spec = SlidingWindowSpec(sliding_window=window, **diff_kv)
        elif kind == "diffkv_full":
            spec = FullAttentionSpec(**diff_kv)
        elif kind == "mla":
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD_SIZE, dtype=DTYPE)
        else:
            # Without vLLM's prefix caching ("none") a state block covers the whole sequence. "mamba2"
            # declares what vLLM's MambaMixer2 does: its forward exports the state at a block boundary
            # inside a step (a prefill checkpoint) into a block of its own.
            checkpoints = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1) \
                if kind == "mamba2" else {}
            spec = MambaSpec(block_size=MAX_MODEL_LEN if mamba_mode == "none" else block_size, shapes=STATE_SHAPES,
                             dtypes=(DTYPE, DTYPE), page_size_padded=page_bytes, mamba_cache_mode=mamba_mode,
                             num_speculative_blocks=spec_blocks,
                             **checkpoints)
        groups.append(KVCacheGroupSpec(names, spec))
    return groups


def cache_config(kinds: list[str], *, block_size: int = 16, window: int = 32, num_blocks: int = 64,
                 mamba_mode: str = "none", spec_blocks: int = 0) -> KVCacheConfig:
    groups = group_specs(kinds, block_size, window, mamba_mode, spec_blocks)
    page_bytes = HEADS * block_size * 2 * HEAD_SIZE * DTYPE.itemsize
    # One tensor per group, each from byte 0 of the one buffer: the groups overlay each other.
    tensors = [KVCacheTensor(size=2 * num_blocks * page_bytes, layers=list(group.layer_names),
                             layer_stride=num_blocks * page_bytes, block_stride=page_bytes)
               for group in groups]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


def vllm_config(model_dir: Path, extra: dict[str, Any], *, block_size: int = 16, max_batched: int = 256,
                role: str = "kv_both", mamba_mode: str | None = None, prefix_caching: bool = False,
                tp: int = 1, kv_events: bool = False, retention_interval: int | None = 0, max_num_seqs: int = 8,
                inflight_kv_loads: int | None = None, spec_tokens: int = 0) -> VllmConfig:
    """``retention_interval``: vLLM's ``prefix_cache_retention_interval`` (its default, 0, keeps a
    recurrent state only where a request may resume; None keeps every one). ``inflight_kv_loads``:
    vLLM 0.34's ``max_num_inflight_kv_loads`` (set, loads may start while the running batch is full)."""
    model = ModelConfig(model=str(model_dir), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    inflight = {"max_num_inflight_kv_loads": inflight_kv_loads} if inflight_kv_loads is not None else {}
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True, is_encoder_decoder=False,
                                disable_hybrid_kv_cache_manager=None, **inflight)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                        prefix_cache_retention_interval=retention_interval)
    cache.kv_cache_layout = "LBHNC"  # resolved by the engine core before connectors exist
    if mamba_mode is not None:
        cache.mamba_cache_mode = mamba_mode
    transfer = KVTransferConfig(kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
                                kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    # KV events on: vLLM's scheduler publishes them (a test replaces the publisher's publish to read them).
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    parallel = ParallelConfig(tensor_parallel_size=tp)
    # ``spec_tokens``: draft tokens per step (ngram speculative decoding; the test's sampler proposes them).
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens, prompt_lookup_max=3,
                             prompt_lookup_min=1, target_model_config=model,
                             target_parallel_config=parallel) if spec_tokens else None
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache, kv_transfer_config=transfer,
                      device_config=DeviceConfig("cpu"), parallel_config=parallel, kv_events_config=events,
                      speculative_config=spec)


def prompt(length: int, seed: int = 0) -> list[int]:
    return [4 + (index * 37 + seed * 101 + 11) % 500 for index in range(length)]


def file_store(tmp_path: Path, chunk_size: int | None = CHUNK, **extra: Any) -> dict[str, Any]:
    """The connector's settings for a file store under ``tmp_path`` (``chunk_size`` None: left out)."""
    chunk = {"chunk_size": chunk_size} if chunk_size is not None else {}
    return {"store": f"file://{tmp_path}/kv", **chunk, **extra}


def token_rows(worker: FakeWorker, block_ids: tuple[tuple[int, ...], ...], positions: range) -> list[torch.Tensor]:
    """Every attention group's K/V rows of token ``positions`` (null blocks skipped) in ``worker``'s caches."""
    rows = []
    for engine_group in worker.side.engine_groups:
        if not engine_group.token_indexed:
            continue
        ids = block_ids[engine_group.index]
        size = engine_group.block_size
        slots = [ids[p // size] * size + p % size for p in positions if ids[p // size] != 0]
        for member in engine_group.members:
            rows.append(worker.side.transfers[member].pack(torch.tensor(slots, dtype=torch.int64))[0])
    return rows


@dataclass
class Step:
    output: Any  # SchedulerOutput
    metadata: KVGroupsConnectorMetadata
    finished_loads: set[str] = field(default_factory=set)  # reported to vLLM after this step
    finished_saves: set[str] = field(default_factory=set)  # finished requests whose last saves were copied
    failed_loads: set[str] = field(default_factory=set)
    invalid_blocks: set[int] = field(default_factory=set)
    scheduler_stats: Any = None  # vLLM's SchedulerStats of the step (its connector stats, hits by source)
    # Requests that finished this step -> the kv_transfer_params of their output (a P/D prefill's hand-over).
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)

    def new(self) -> dict[str, int]:
        """Requests scheduled for the first time this step -> their computed tokens (local + loaded)."""
        return {new.req_id: new.num_computed_tokens for new in self.output.scheduled_new_reqs}


def connector_stats(steps: list[Step], worker: FakeWorker) -> KVGroupsConnectorStats:
    """Every step's connector stats summed, as vLLM's front end does with build_kv_connector_stats, and
    what the worker reports at its next step (saves are written in the background, after their step)."""
    total = KVGroupsConnector.build_kv_connector_stats()
    for step in steps:
        payload = step.scheduler_stats.kv_connector_stats if step.scheduler_stats is not None else None
        if payload:
            total.aggregate(KVGroupsConnector.build_kv_connector_stats(payload))
    worker.side.flush()
    assert worker.side.stats is not None
    later = worker.side.stats.take()
    if later is not None:
        total.aggregate(KVGroupsConnector.build_kv_connector_stats(later))
    return total


@dataclass
class SchedulerHarness:
    """vLLM's Scheduler with the connector, stepped by hand with fake model outputs."""

    config: VllmConfig
    kv_cache_config: KVCacheConfig
    # The block size requests are hashed in: the scheduler's (below) unless given, as vLLM's engine core resolves
    # it for groups of several block sizes with prefix caching or a connector on (their GCD: DeepSeek-V4's 4).
    hash_block_size: int | None = None
    scheduler: Scheduler = field(init=False)

    def __post_init__(self) -> None:
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        # The scheduler's granularity is the LCM of the groups' block sizes, as the engine sets it.
        block_size = math.lcm(*(group.kv_cache_spec.block_size for group in self.kv_cache_config.kv_cache_groups))
        hash_block_size = self.hash_block_size or block_size
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=block_size, hash_block_size=hash_block_size, log_stats=True)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(hash_block_size, sha256)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(self, request_id: str, tokens: list[int], *, max_tokens: int = 2, cache_salt: str | None = None,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        request = Request(request_id=request_id, prompt_token_ids=tokens,
                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
                          pooling_params=None, block_hasher=self.hasher, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        return request

    def step(self, worker: FakeWorker | tuple[FakeWorker, ...] | None = None, *, before_load: Any = None,
             forward: Any = None, sampler: Any = None) -> Step:
        """One engine step: schedule, hand the plans to ``worker`` (or to each tensor-parallel rank's:
        loads, ``forward(step)`` standing in for the model, saves; asynchronous loads run to their end
        within the step, ``before_load()`` first), and report what it finished (as vLLM aggregates
        ranks: a load finished once every rank's is, failed where any rank's did). ``sampler``: the
        tokens each request sampled (``sampler.sample(request, drafts)``, accepted drafts first) and the
        drafts it proposes for the next step (``sampler.propose(request)``); else token 7, no drafts."""
        output = self.scheduler.schedule()
        metadata = output.kv_connector_metadata
        assert isinstance(metadata, KVGroupsConnectorMetadata)
        step = Step(output, metadata)
        connector_output = None
        workers = worker if isinstance(worker, tuple) else (worker,) if worker is not None else ()
        if workers:
            if before_load is not None and metadata.loads:
                before_load()
            finished: list[set[str]] = []
            sent: list[set[str]] = []
            for each in workers:
                each.side.load(metadata)
            if forward is not None:
                forward(step)
            for each in workers:
                each.side.save(metadata)
                assert each.side.wait_for_loads(timeout=60)
                done, failed = each.side.finished_loads()
                finished.append(done)
                sent.append(each.side.finished_saves())
                step.failed_loads |= failed
                step.invalid_blocks |= each.side.take_load_errors()
            step.finished_loads = set.intersection(*finished)
            step.finished_saves = set.intersection(*sent)
            # The entries each rank wrote or deleted (build_connector_worker_meta), aggregated as vLLM does.
            reports = [report for each in workers if each.side.reports is not None
                       and (report := each.side.reports.take()) is not None]
            worker_meta = functools.reduce(lambda one, other: one.aggregate(other), reports) if reports else None
            worker = workers[0]
            # What the worker's connector hands vLLM each step (KVGroupsConnector.get_kv_connector_stats).
            stats = worker.side.stats.take() if worker.side.stats is not None else None
            connector_output = KVConnectorOutput(finished_sending=step.finished_saves or None,
                                                 finished_recving=step.finished_loads or None,
                                                 failed_recving=step.failed_loads,
                                                 invalid_block_ids=step.invalid_blocks,
                                                 kv_connector_stats=KVGroupsConnectorStats(stats) if stats else None,
                                                 kv_connector_worker_meta=worker_meta)
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            request = self.scheduler.requests[request_id]
            if sampler is not None:
                sampled.append(sampler.sample(request, output.scheduled_spec_decode_tokens.get(request_id, [])))
            else:
                sampled.append([7] if request.num_computed_tokens >= request.num_prompt_tokens else [])
        # vLLM 0.34 dropped req_id_to_index (the index is the position in req_ids).
        index = ({"req_id_to_index": {request_id: index for index, request_id in enumerate(ids)}}
                 if "req_id_to_index" in {field.name for field in dataclasses.fields(ModelRunnerOutput)} else {})
        outputs = self.scheduler.update_from_output(output, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=connector_output, **index))
        if sampler is not None:
            running = [request_id for request_id in ids if request_id in self.scheduler.requests
                       and not self.scheduler.requests[request_id].is_finished()]
            self.scheduler.update_draft_token_ids(DraftTokenIds(
                running, [sampler.propose(self.scheduler.requests[request_id]) for request_id in running]))
        step.scheduler_stats = next((outputs[index].scheduler_stats for index in outputs), None)
        step.kv_transfer_params = {output.request_id: output.kv_transfer_params for index in outputs
                                   for output in outputs[index].outputs if output.kv_transfer_params is not None}
        return step

    def run(self, worker: FakeWorker | tuple[FakeWorker, ...] | None = None, max_steps: int = 50, *,
            forward: Any = None, sampler: Any = None) -> list[Step]:
        """Step until every request finished and vLLM holds none of their blocks (as an engine steps on
        while a connector saves a finished request's), handing each step's plans to ``worker``."""
        steps: list[Step] = []
        while self.scheduler.has_requests() and len(steps) < max_steps:
            steps.append(self.step(worker, forward=forward, sampler=sampler))
            if not steps[-1].output.num_scheduled_tokens:
                time.sleep(0.005)  # a lookup or a load runs in the background
        for each in worker if isinstance(worker, tuple) else (worker,) if worker is not None else ():
            each.side.flush()
        return steps

    def admit(self, worker: FakeWorker | tuple[FakeWorker, ...], request_id: str, *, before_load: Any = None,
              forward: Any = None, deadline_seconds: float = 30.0) -> tuple[list[Step], int, Any]:
        """Step until ``request_id`` is scheduled: the steps, its computed tokens then (local + loaded),
        and its load plan (None without one). A step that schedules nothing (a lookup running in
        the background) is followed by a short sleep."""
        steps: list[Step] = []
        deadline = time.monotonic() + deadline_seconds
        while time.monotonic() < deadline:
            steps.append(self.step(worker, before_load=before_load, forward=forward))
            if request_id in steps[-1].new():
                loads = [plan for step in steps for plan in step.metadata.loads if plan.request_id == request_id]
                return steps, steps[-1].new()[request_id], loads[-1] if loads else None
            if not steps[-1].output.num_scheduled_tokens:
                time.sleep(0.005)
        raise AssertionError(f"{request_id} was not scheduled in {deadline_seconds} s ({len(steps)} steps)")


class FakeWorker:
    """A worker's caches laid out as vLLM allocates them, bound to a WorkerSide."""

    def __init__(self, config: VllmConfig, kv_cache_config: KVCacheConfig, layout: KVLayout = ENGINE_LAYOUT,
                 seed: int = 0, rank: int = 0) -> None:
        self.deployment = Deployment(config, kv_cache_config, layout=layout)
        self.kv_cache_config = kv_cache_config
        size = kv_cache_config.kv_cache_tensors[0].size
        generator = torch.Generator().manual_seed(seed)
        self.buffer = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator)
        self.caches = self._views(layout)
        self.side = WorkerSide(self.deployment, rank=rank)
        self.side.register(self.caches)

    def _views(self, layout: KVLayout) -> dict[str, torch.Tensor]:
        caches = {}
        num_blocks = self.kv_cache_config.num_blocks
        for tensor in self.kv_cache_config.kv_cache_tensors:
            for slot, name in enumerate(tensor.layers):
                raw = self.buffer[slot * tensor.layer_stride:(slot + 1) * tensor.layer_stride]
                spec = next(group.kv_cache_spec for group in self.kv_cache_config.kv_cache_groups
                            if name in group.layer_names)
                if isinstance(spec, MambaSpec):
                    caches[name] = raw.view(num_blocks, 1, 1, tensor.block_stride)
                elif isinstance(spec, MLAAttentionSpec):  # one latent row per token, no head axis to order
                    caches[name] = raw.view(DTYPE).view(num_blocks, 1, spec.block_size, MLA_HEAD_SIZE)
                elif layout is KVLayout.VLLM:  # GPU backends: tokens outside heads in memory (LBNHC)
                    width = spec.head_size + spec.head_size_v  # 2 * HEAD_SIZE, or a diff-KV page's K + V
                    caches[name] = raw.view(DTYPE).view(num_blocks, spec.block_size, HEADS, width).permute(0, 2, 1, 3)
                else:
                    caches[name] = raw.view(DTYPE).view(num_blocks, HEADS, spec.block_size, 2 * HEAD_SIZE)
        return caches
