"""One tensor-parallel rank of a model as a serving engine would hold it, built on the meta device.

:class:`EngineParams` says how the engine holds the cache (ranks, block size, layout, dtypes,
memory or context); :func:`build_rank` turns a :class:`~kvgroups.models.layers.ModelSpec` into
that rank's layer caches (meta tensors in the engine layout), groups them with
``build_kv_layer_groups`` and describes them with ``LMCacheMetadata``. ``num_blocks`` comes
from ``--memory`` (what the budget leaves after the states, in blocks) or ``--tokens``, using the
same byte counts the groups report, so the rank is built once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.dtypes import dtype_from_name
from kvgroups.errors import KVGroupsError
from kvgroups.kinds import LayerCacheSpec
from kvgroups.layouts import CacheGeometry, KVLayout, shape_for
from kvgroups.metadata import LMCacheMetadata
from kvgroups.models.layers import ModelSpec, RankCache
from kvgroups.sizes import GIB, ceil_div


@dataclass(frozen=True, kw_only=True)
class EngineParams:
    """How the engine would hold the cache. ``kv_dtype``/``state_dtype`` None: the config's dtype."""

    tp: int = 1
    rank: int = 0
    block_size: int = 16
    layout: KVLayout = KVLayout.FLASH_ATTN
    kv_dtype: torch.dtype | None = None
    state_dtype: torch.dtype | None = None
    chunk_size: int = 256
    memory_gib: float | None = None
    tokens: int | None = None
    seqs: int = 1

    def __post_init__(self) -> None:
        problems = []
        for name in ("tp", "block_size", "chunk_size", "seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if isinstance(self.tp, int) and not (isinstance(self.rank, int) and 0 <= self.rank < self.tp):
            problems.append(f"--rank must be in [0, --tp={self.tp}), got {self.rank!r}")
        if self.memory_gib is not None and not (math.isfinite(self.memory_gib) and self.memory_gib > 0):
            problems.append(f"--memory must be a positive number of GiB, got {self.memory_gib!r}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 1):
            problems.append(f"--tokens must be an int >= 1, got {self.tokens!r}")
        if not self.layout.holds_kv:
            problems.append(f"--layout must be a K/V layout, got {self.layout.value}")
        if problems:
            raise KVGroupsError("; ".join(problems))

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_gib is None else int(self.memory_gib * GIB)


@dataclass(frozen=True, kw_only=True)
class _LayerPlan:
    """One layer with a cache on this rank: what it is, in which layout, and its sizes per block."""

    model_layer: int
    cache: RankCache
    layout: KVLayout
    geometry: CacheGeometry  # num_blocks 1 (token caches) or one state slot per sequence
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        return self.geometry.slot_elements * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class RankBuild:
    """What :func:`build_rank` built: the metadata with its groups, and where each cache came from."""

    metadata: LMCacheMetadata
    model_layer_of: dict[str, int]  # cache name -> model layer number
    num_blocks: int
    kv_dtype: torch.dtype
    state_dtype: torch.dtype
    layers_with_cache: int


def _plan(index: int, cache: RankCache, params: EngineParams, kv_dtype: torch.dtype,
          state_dtype: torch.dtype) -> _LayerPlan:
    spec = cache.spec
    if not spec.token_indexed:
        layout, dtype = KVLayout.RECURRENT, state_dtype
        geometry = CacheGeometry(kv_size=1, num_blocks=params.seqs, block_size=1, num_heads=1,
                                 head_size=spec.state_elements)
    else:
        layout = params.layout if spec.accepts_layout(params.layout) else KVLayout.MLA
        dtype = kv_dtype
        geometry = CacheGeometry(kv_size=layout.kv_size, num_blocks=1, block_size=params.block_size,
                                 num_heads=cache.num_kv_heads if layout.holds_kv else 1, head_size=cache.head_size)
    return _LayerPlan(model_layer=index, cache=cache, layout=layout, geometry=geometry, dtype=dtype)


def _num_blocks(params: EngineParams, plans: list[_LayerPlan]) -> int:
    """Blocks per layer tensor: what --memory leaves after the states, or what --tokens needs."""
    token_bytes = sum(plan.cache.spec.bytes_per_token(plan.slot_bytes) for plan in plans)
    state_bytes = sum(plan.cache.spec.bytes_per_sequence(plan.slot_bytes) for plan in plans)
    budget = params.memory_bytes
    if budget is not None and token_bytes:
        blocks = (budget - state_bytes * params.seqs) // (token_bytes * params.block_size)
        if blocks < 1:
            raise KVGroupsError(
                f"--memory {params.memory_gib} GiB holds not even one block of {params.block_size} tokens "
                f"({token_bytes * params.block_size} B per rank) after {state_bytes * params.seqs} B of "
                f"recurrent state"
            )
        return int(blocks)
    tokens = params.tokens if params.tokens is not None else params.chunk_size
    return params.seqs * ceil_div(tokens, params.block_size)


def _layer_value(plan: _LayerPlan, num_blocks: int) -> Any:
    """A meta-device cache value for one layer on one rank."""
    spec: LayerCacheSpec = plan.cache.spec
    if not spec.token_indexed:
        return tuple(
            torch.empty(plan.geometry.num_blocks, *shape, dtype=plan.dtype, device="meta")
            for shape in spec.state_shapes
        )
    geometry = CacheGeometry(kv_size=plan.geometry.kv_size, num_blocks=num_blocks, block_size=plan.geometry.block_size,
                             num_heads=plan.geometry.num_heads, head_size=plan.geometry.head_size)
    shape = shape_for(plan.layout, geometry)
    tensors = [torch.empty(shape, dtype=plan.dtype, device="meta") for _ in range(plan.layout.tensors_per_layer or 1)]
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def build_rank(spec: ModelSpec, model_name: str, params: EngineParams) -> RankBuild:
    """The caches of rank ``params.rank`` of ``spec`` on the meta device, grouped and described."""
    config_dtype = dtype_from_name(spec.torch_dtype)
    kv_dtype = params.kv_dtype or config_dtype
    state_dtype = params.state_dtype or config_dtype
    plans = []
    for index, layer in enumerate(spec.layers):
        cache = layer.rank_cache(params.tp, index)
        if cache is not None:
            plans.append(_plan(index, cache, params, kv_dtype, state_dtype))
    if not plans:
        raise KVGroupsError(f"model {model_name!r} has no layer that keeps a cache")
    num_blocks = _num_blocks(params, plans)
    caches = {f"model.layers.{plan.model_layer}": _layer_value(plan, num_blocks) for plan in plans}
    names = list(caches)
    specs = {name: plan.cache.spec for name, plan in zip(names, plans, strict=True)}
    layouts = {name: plan.layout for name, plan in zip(names, plans, strict=True) if plan.cache.spec.token_indexed}
    use_mla = any(layout is KVLayout.MLA for layout in layouts.values())
    first = plans[0].cache
    kv_shape = (len(caches), 1 if use_mla else 2, params.chunk_size, 1 if use_mla else first.num_kv_heads,
                first.head_size)
    metadata = LMCacheMetadata(
        model_name=model_name, world_size=params.tp, local_world_size=params.tp, worker_id=params.rank,
        local_worker_id=params.rank, kv_dtype=kv_dtype, kv_shape=kv_shape, use_mla=use_mla,
        chunk_size=params.chunk_size,
    )
    metadata.kv_layer_groups_manager.build_kv_layer_groups(caches, specs, layout=layouts)
    return RankBuild(
        metadata=metadata,
        model_layer_of={name: plan.model_layer for name, plan in zip(names, plans, strict=True)},
        num_blocks=num_blocks, kv_dtype=kv_dtype, state_dtype=state_dtype, layers_with_cache=len(plans),
    )
