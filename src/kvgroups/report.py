"""``kvgroups inspect`` without the printing: a model's caches built on the meta device, grouped,
described by ``LMCacheMetadata``, and costed per rank.

The numbers come from the same objects a serving engine's connector would build
(``build_kv_layer_groups`` on real-shaped tensors, ``metadata.get_shapes``), not from a parallel
formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.capacity import Fit, GroupCost, memory_needed, tokens_that_fit
from kvgroups.dtypes import dtype_from_name, dtype_name
from kvgroups.errors import KVGroupsError
from kvgroups.formatting import compact_ranges
from kvgroups.groups import KVLayerGroupInfo
from kvgroups.kinds import LayerCacheSpec, RecurrentState
from kvgroups.layouts import CacheGeometry, KVLayout, shape_for
from kvgroups.metadata import LMCacheMetadata
from kvgroups.model_layers import ModelSpec, RankCache

REPORT_FORMAT = "kvgroups.inspect/1"
GIB = 1 << 30


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
        if self.layout in (KVLayout.MLA, KVLayout.RECURRENT):
            problems.append(f"--layout must be a K/V layout, got {self.layout.value}")
        if problems:
            raise KVGroupsError("; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class GroupReport:
    """One group's row of the report (all sizes per rank)."""

    group: KVLayerGroupInfo
    model_layers: tuple[int, ...]
    chunk_shape: torch.Size
    bytes_per_token: int
    bytes_per_sequence: int
    chunk_bytes: int

    def to_dict(self, index: int) -> dict[str, Any]:
        group = self.group
        return {
            "index": index,
            "layers": compact_ranges(self.model_layers),
            "model_layers": list(self.model_layers),
            "layer_indices": list(group.layer_indices),
            "num_layers": group.num_layers,
            "kind": group.kind.value,
            "spec": group.spec.to_dict(),
            "layout": group.layout.value,
            "tensor_shape": list(group.shape),
            "tensors_per_layer": group.layout.tensors_per_layer or len(_state_shapes(group.spec)),
            "dtype": dtype_name(group.dtype),
            "num_kv_heads": group.num_heads,
            "head_size": group.head_size,
            "hidden_dim_size": group.hidden_dim_size,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_sequence": self.bytes_per_sequence,
            "chunk_shape": list(self.chunk_shape),
            "chunk_bytes": self.chunk_bytes,
        }


def _state_shapes(spec: LayerCacheSpec) -> tuple[tuple[int, ...], ...]:
    return spec.state_shapes if isinstance(spec, RecurrentState) else ()


@dataclass(frozen=True, kw_only=True)
class Report:
    model_name: str
    source: str
    model: ModelSpec
    params: EngineParams
    kv_dtype: torch.dtype
    state_dtype: torch.dtype
    num_blocks: int
    groups: tuple[GroupReport, ...]
    metadata: LMCacheMetadata
    layers_with_cache: int

    @property
    def bytes_per_token_per_rank(self) -> int:
        return sum(row.bytes_per_token for row in self.groups)

    @property
    def state_bytes_per_sequence_per_rank(self) -> int:
        return sum(row.bytes_per_sequence for row in self.groups)

    @property
    def bytes_per_chunk_per_rank(self) -> int:
        return sum(row.chunk_bytes for row in self.groups)

    def costs(self) -> list[GroupCost]:
        return [
            GroupCost(spec=row.group.spec, bytes_per_token=row.bytes_per_token,
                      bytes_per_sequence=row.bytes_per_sequence)
            for row in self.groups
        ]

    def memory_for_tokens(self, *, hybrid: bool) -> int | None:
        if self.params.tokens is None:
            return None
        return memory_needed(self.costs(), self.params.tokens, self.params.seqs, self.params.block_size,
                             hybrid=hybrid)

    def fit_in_memory(self, *, hybrid: bool) -> Fit | None:
        if self.params.memory_gib is None:
            return None
        return tokens_that_fit(
            self.costs(), int(self.params.memory_gib * GIB), self.params.seqs, self.params.block_size,
            self.model.max_position_embeddings, hybrid=hybrid,
        )

    def to_dict(self) -> dict[str, Any]:
        params, tp = self.params, self.params.tp
        capacity: dict[str, Any] = {"memory": None, "tokens": None}
        hybrid_fit, full_fit = self.fit_in_memory(hybrid=True), self.fit_in_memory(hybrid=False)
        if hybrid_fit is not None and full_fit is not None:
            capacity["memory"] = {
                "budget_bytes_per_rank": int(params.memory_gib * GIB) if params.memory_gib else 0,
                "sequences": params.seqs,
                "tokens_per_sequence": hybrid_fit.tokens_per_sequence,
                "total_tokens": hybrid_fit.tokens_per_sequence * params.seqs,
                "limited_by": hybrid_fit.limited_by,
                "tokens_per_sequence_all_full": full_fit.tokens_per_sequence,
                "total_tokens_all_full": full_fit.tokens_per_sequence * params.seqs,
                "limited_by_all_full": full_fit.limited_by,
            }
        hybrid_need, full_need = self.memory_for_tokens(hybrid=True), self.memory_for_tokens(hybrid=False)
        if hybrid_need is not None and full_need is not None:
            capacity["tokens"] = {
                "tokens_per_sequence": params.tokens,
                "sequences": params.seqs,
                "bytes_per_rank": hybrid_need,
                "bytes_all_ranks": hybrid_need * tp,
                "bytes_per_rank_all_full": full_need,
                "bytes_all_ranks_all_full": full_need * tp,
            }
        return {
            "format": REPORT_FORMAT,
            "model": self.model_name,
            "source": self.source,
            "model_type": self.model.model_type,
            "max_position_embeddings": self.model.max_position_embeddings,
            "engine": {
                "tp": tp, "rank": params.rank, "block_size": params.block_size, "layout": params.layout.value,
                "kv_dtype": dtype_name(self.kv_dtype), "state_dtype": dtype_name(self.state_dtype),
                "chunk_size": params.chunk_size, "num_blocks": self.num_blocks, "memory_gib": params.memory_gib,
                "tokens": params.tokens, "seqs": params.seqs,
            },
            "layers": {"total": len(self.model.layers), "with_cache": self.layers_with_cache},
            "groups": [row.to_dict(index) for index, row in enumerate(self.groups)],
            "totals": {
                "bytes_per_token_per_rank": self.bytes_per_token_per_rank,
                "bytes_per_token_all_ranks": self.bytes_per_token_per_rank * tp,
                "state_bytes_per_sequence_per_rank": self.state_bytes_per_sequence_per_rank,
                "state_bytes_per_sequence_all_ranks": self.state_bytes_per_sequence_per_rank * tp,
                "bytes_per_chunk_per_rank": self.bytes_per_chunk_per_rank,
                "fingerprint": self.metadata.fingerprint(),
            },
            "capacity": capacity,
            "warnings": list(self.model.warnings),
            "metadata": self.metadata.to_dict(),
        }


def _layer_value(
    cache: RankCache, layout: KVLayout, num_blocks: int, block_size: int, num_sequences: int,
    kv_dtype: torch.dtype, state_dtype: torch.dtype,
) -> tuple[Any, KVLayout | None]:
    """A meta-device cache for one layer on one rank, and the layout to declare for it."""
    if isinstance(cache.spec, RecurrentState):
        states = tuple(
            torch.empty(num_sequences, *shape, dtype=state_dtype, device="meta")
            for shape in cache.spec.state_shapes
        )
        return states, None
    if cache.spec.accepts_layout(KVLayout.MLA):
        return torch.empty(num_blocks, block_size, cache.head_size, dtype=kv_dtype, device="meta"), KVLayout.MLA
    sizes = CacheGeometry(kv_size=2, num_blocks=num_blocks, block_size=block_size,
                          num_heads=cache.num_kv_heads, head_size=cache.head_size)
    shape = shape_for(layout, sizes)
    tensor = torch.empty(shape, dtype=kv_dtype, device="meta")
    if layout.tensors_per_layer == 2:
        return (tensor, torch.empty(shape, dtype=kv_dtype, device="meta")), layout
    return tensor, layout


def _num_blocks(params: EngineParams, token_bytes_per_rank: int, state_bytes_per_rank: int) -> int:
    """Blocks per layer tensor: what --memory leaves after the states, or what --tokens needs."""
    if params.memory_gib is not None and token_bytes_per_rank:
        available = int(params.memory_gib * GIB) - state_bytes_per_rank * params.seqs
        blocks = available // (token_bytes_per_rank * params.block_size)
        if blocks < 1:
            raise KVGroupsError(
                f"--memory {params.memory_gib} GiB holds not even one block of {params.block_size} tokens "
                f"({token_bytes_per_rank * params.block_size} B per rank) after "
                f"{state_bytes_per_rank * params.seqs} B of recurrent state"
            )
        return int(blocks)
    tokens = params.tokens if params.tokens is not None else params.chunk_size
    return params.seqs * -(-tokens // params.block_size)


def _build_rank(
    model_name: str, params: EngineParams, with_cache: list[tuple[int, RankCache]], num_blocks: int,
    kv_dtype: torch.dtype, state_dtype: torch.dtype,
) -> tuple[LMCacheMetadata, dict[str, int]]:
    """Meta-device caches of one rank, grouped; and the model layer number of each cache name."""
    caches: dict[str, Any] = {}
    layouts: dict[str, KVLayout] = {}
    specs: dict[str, LayerCacheSpec] = {}
    model_layer_of: dict[str, int] = {}
    for index, cache in with_cache:
        name = f"model.layers.{index}"
        value, layout = _layer_value(cache, params.layout, num_blocks, params.block_size, params.seqs,
                                     kv_dtype, state_dtype)
        caches[name], specs[name], model_layer_of[name] = value, cache.spec, index
        if layout is not None:
            layouts[name] = layout
    use_mla = any(layout is KVLayout.MLA for layout in layouts.values())
    first = with_cache[0][1]
    kv_shape = (len(caches), 1 if use_mla else 2, params.chunk_size,
                1 if use_mla else first.num_kv_heads, first.head_size)
    metadata = LMCacheMetadata(
        model_name=model_name, world_size=params.tp, local_world_size=params.tp, worker_id=params.rank,
        local_worker_id=params.rank, kv_dtype=kv_dtype, kv_shape=kv_shape, use_mla=use_mla,
        chunk_size=params.chunk_size,
    )
    metadata.kv_layer_groups_manager.build_kv_layer_groups(caches, specs, layout=layouts)
    return metadata, model_layer_of


def _group_rows(metadata: LMCacheMetadata, model_layer_of: dict[str, int]) -> tuple[GroupReport, ...]:
    rows = []
    groups = metadata.kv_layer_groups_manager.kv_layer_groups
    for group, chunk_shape in zip(groups, metadata.get_shapes(), strict=True):
        element_bytes = group.dtype.itemsize
        per_layer = group.kv_size * group.hidden_dim_size * element_bytes
        token_indexed = group.layout.is_token_indexed
        rows.append(GroupReport(
            group=group,
            model_layers=tuple(model_layer_of[name] for name in group.layer_names),
            chunk_shape=chunk_shape,
            bytes_per_token=per_layer * group.num_layers if token_indexed else 0,
            bytes_per_sequence=0 if token_indexed else per_layer * group.num_layers,
            chunk_bytes=math.prod(chunk_shape) * element_bytes,
        ))
    return tuple(rows)


def inspect_model(spec: ModelSpec, model_name: str, params: EngineParams, source: str = "") -> Report:
    """Build the caches of ``spec`` on the meta device for one rank and describe them."""
    config_dtype = dtype_from_name(spec.torch_dtype)
    kv_dtype = params.kv_dtype or config_dtype
    state_dtype = params.state_dtype or config_dtype
    rank_caches = [(index, layer.rank_cache(params.tp, index)) for index, layer in enumerate(spec.layers)]
    with_cache = [(index, cache) for index, cache in rank_caches if cache is not None]
    if not with_cache:
        raise KVGroupsError(f"model {model_name!r} has no layer that keeps a cache")
    # The groups are the one source of sizes. num_blocks only sets the tensors' first axis, so a
    # one-block probe gives the costs that decide it (meta tensors make building twice free).
    probe = _group_rows(*_build_rank(model_name, params, with_cache, 1, kv_dtype, state_dtype))
    num_blocks = _num_blocks(params, sum(row.bytes_per_token for row in probe),
                             sum(row.bytes_per_sequence for row in probe))
    metadata, model_layer_of = _build_rank(model_name, params, with_cache, num_blocks, kv_dtype, state_dtype)
    return Report(
        model_name=model_name, source=source, model=spec, params=params, kv_dtype=kv_dtype,
        state_dtype=state_dtype, num_blocks=num_blocks, groups=_group_rows(metadata, model_layer_of),
        metadata=metadata, layers_with_cache=len(with_cache),
    )
