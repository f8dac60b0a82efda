"""One tensor-parallel rank of a model as a serving engine would hold it, built on the meta device.

:class:`EngineParams` says how the engine holds the cache (ranks, block size, layout, dtypes,
memory or context, images); :func:`build_rank` turns a :class:`~kvgroups.models.layers.ModelSpec`
into that rank's layer caches (meta tensors in the engine layout), groups them with
``build_kv_layer_groups`` and describes them with ``LMCacheMetadata``. A model layer may hold
several caches (named ``model.layers.N.<mixer>``); the state tensors of one recurrent mixer that
share a dtype are one cache. ``num_blocks`` comes from ``--memory`` (what the budget leaves after
the states and images, in blocks) or ``--tokens``, using the same byte counts the groups report,
so the rank is built once. Cross-attention caches (image tokens) are costed per image and not
grouped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.core.cache_specs import LayerCacheSpec, RecurrentState
from kvgroups.core.checks import is_int_at_least
from kvgroups.core.layouts import CacheGeometry, KVLayout, shape_for
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.core.sizes import GIB, ceil_div, round_up
from kvgroups.errors import KVGroupsError
from kvgroups.models.cache_dtypes import CacheDtypes, resolve_dtypes
from kvgroups.models.layers import ModelSpec, RankCache, RowPacking


@dataclass(frozen=True, kw_only=True)
class EngineParams:
    """How the engine would hold the cache. Dtypes None: as :mod:`kvgroups.models.cache_dtypes` says.

    ``images`` per sequence and ``image_tokens`` per image (None: what the config implies) size
    the cross-attention caches of models that have them. ``layout`` None: :data:`DEFAULT_LAYOUT`,
    or for a model whose values differ from its keys in head size the layout vLLM holds them in
    (:data:`DIFF_KV_LAYOUT`, unpadded).
    """

    tp: int = 1
    rank: int = 0
    block_size: int = 16
    layout: KVLayout | None = None
    kv_dtype: torch.dtype | None = None
    state_dtype: torch.dtype | None = None
    conv_state_dtype: torch.dtype | None = None
    ssm_state_dtype: torch.dtype | None = None
    chunk_size: int = 256
    memory_gib: float | None = None
    tokens: int | None = None
    seqs: int = 1
    images: int = 0
    image_tokens: int | None = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("tp", "block_size", "chunk_size", "seqs"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                problems.append(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if isinstance(self.tp, int) and not (isinstance(self.rank, int) and 0 <= self.rank < self.tp):
            problems.append(f"--rank must be in [0, --tp={self.tp}), got {self.rank!r}")
        if self.memory_gib is not None and not (math.isfinite(self.memory_gib) and self.memory_gib > 0):
            problems.append(f"--memory must be a positive number of GiB, got {self.memory_gib!r}")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 1):
            problems.append(f"--tokens must be an int >= 1, got {self.tokens!r}")
        if not is_int_at_least(self.images, 0):
            problems.append(f"--images must be an int >= 0, got {self.images!r}")
        if self.image_tokens is not None and (not isinstance(self.image_tokens, int) or self.image_tokens < 1):
            problems.append(f"--image-tokens must be an int >= 1, got {self.image_tokens!r}")
        if self.layout is not None and not self.layout.holds_kv:
            problems.append(f"--layout must be a K/V layout, got {self.layout.value}")
        if problems:
            raise KVGroupsError("; ".join(problems))

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_gib is None else int(self.memory_gib * GIB)


# The layout a model's attention caches are planned in when none is asked for; a model with values of
# another head size than its keys gets vLLM's pages (keys then values, unpadded), as vLLM, the engine
# that serves such models, allocates them.
DEFAULT_LAYOUT = KVLayout.FLASH_ATTN
DIFF_KV_LAYOUT = KVLayout.VLLM


@dataclass(frozen=True, kw_only=True)
class Page:
    """A page an engine fixes for one layer's cache: ``block_tokens`` tokens in ``page_bytes`` (padded), of which
    ``content_bytes`` are the cache's."""

    block_tokens: int
    page_bytes: int
    content_bytes: int


# Where a model's engine packs its rows (vLLM's fp8_ds_mla for DeepSeek-V4, with an 8-bit KV dtype),
# every page of the model is padded to this many bytes; otherwise to the other.
PACKED_PAGE_ALIGNMENT = 576
PLAIN_PAGE_ALIGNMENT = 512


@dataclass(frozen=True, kw_only=True)
class _LayerPlan:
    """One cache of a layer on this rank: what it is, in which layout, and its sizes per block."""

    name: str
    model_layer: int
    cache: RankCache
    layout: KVLayout
    geometry: CacheGeometry  # num_blocks 1 (token caches) or one state slot per sequence
    dtype: torch.dtype
    page: Page | None = None  # the engine's own page for this cache, where it fixes one

    @property
    def slot_bytes(self) -> int:
        return self.geometry.slot_elements * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True)
class CrossAttention:
    """The image-token caches of one rank: what one image costs in all cross-attention layers."""

    model_layers: tuple[int, ...]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    tokens_per_image: int
    images: int

    @property
    def bytes_per_image(self) -> int:
        return len(self.model_layers) * self.tokens_per_image * 2 * self.num_kv_heads * self.head_size * (
            self.dtype.itemsize
        )

    @property
    def bytes_per_sequence(self) -> int:
        return self.bytes_per_image * self.images


@dataclass(frozen=True, kw_only=True)
class RankBuild:
    """What :func:`build_rank` built: the metadata with its groups, and where each cache came from."""

    metadata: LMCacheMetadata
    layout: KVLayout  # the attention caches' layout (the one asked for, or the default for the model)
    model_layer_of: dict[str, int]  # cache name -> model layer number
    pages_of: dict[str, Page]  # cache name -> the engine's own page, where it fixes one
    padded_values_of: dict[str, int]  # cache name -> its values' head size, where the layout pads them
    holds_of: dict[str, str]  # cache name -> what it holds ("mamba2 conv+ssm")
    num_blocks: int
    dtypes: CacheDtypes
    layers_with_cache: int
    cross_attention: CrossAttention | None


def _packed_plan(name: str, index: int, cache: RankCache, dtype: torch.dtype, packing: RowPacking,
                 kv_dtype: torch.dtype) -> _LayerPlan:
    """A cache in pages its engine fixes: blocks of the engine's own tokens, pages padded to the alignment
    of the model's layout; with an 8-bit KV dtype (vLLM's fp8_ds_mla) rows packed into bytes."""
    packed_layout = kv_dtype.itemsize == 1
    head_size = cache.head_size
    if packed_layout and packing.packed_row_bytes is not None and cache.fixed_dtype is None:
        dtype, head_size = torch.uint8, packing.packed_row_bytes
    alignment = PACKED_PAGE_ALIGNMENT if packed_layout else PLAIN_PAGE_ALIGNMENT
    slots = cache.spec.chunk_slots(packing.block_tokens)
    geometry = CacheGeometry(kv_size=1, num_blocks=1, block_size=slots, num_heads=1, head_size=head_size)
    content = slots * head_size * dtype.itemsize
    page = Page(block_tokens=packing.block_tokens, page_bytes=round_up(content, alignment), content_bytes=content)
    return _LayerPlan(name=name, model_layer=index, cache=cache, layout=KVLayout.MLA, geometry=geometry, dtype=dtype,
                      page=page)


def _plan(name: str, index: int, cache: RankCache, dtype: torch.dtype, params: EngineParams,
          kv_layout: KVLayout, kv_dtype: torch.dtype) -> _LayerPlan:
    spec = cache.spec
    if cache.packing is not None:
        return _packed_plan(name, index, cache, dtype, cache.packing, kv_dtype)
    if not spec.token_indexed:
        layout = KVLayout.RECURRENT
        geometry = CacheGeometry(kv_size=1, num_blocks=params.seqs, block_size=1, num_heads=1,
                                 head_size=spec.state_elements)
    else:
        layout = kv_layout if spec.accepts_layout(kv_layout) and not cache.single_row else KVLayout.MLA
        head_size, value_head_size = cache.head_size, cache.value_head_size
        if value_head_size is not None and not layout.holds_value_head_size:
            # K and V planes of one head size: values held padded to the larger.
            head_size, value_head_size = max(head_size, value_head_size), None
        geometry = CacheGeometry(kv_size=layout.kv_size, num_blocks=1, block_size=params.block_size,
                                 num_heads=cache.num_kv_heads if layout.holds_kv else 1, head_size=head_size,
                                 value_head_size=value_head_size)
    return _LayerPlan(name=name, model_layer=index, cache=cache, layout=layout, geometry=geometry, dtype=dtype)


def _merged(caches: tuple[RankCache, ...], dtypes: CacheDtypes) -> list[tuple[RankCache, torch.dtype]]:
    """A layer's caches with their dtypes; consecutive states of one mixer in one dtype become one cache."""
    merged: list[tuple[RankCache, torch.dtype]] = []
    for cache in caches:
        dtype = dtypes.of(cache)
        if merged and not cache.spec.token_indexed:
            previous, previous_dtype = merged[-1]
            if not previous.spec.token_indexed and previous.mixer == cache.mixer and previous_dtype == dtype:
                spec = RecurrentState(state_shapes=previous.spec.state_shapes + cache.spec.state_shapes)
                merged[-1] = (dataclasses.replace(previous, spec=spec, head_size=spec.state_elements,
                                                  part=f"{previous.part}+{cache.part}"), dtype)
                continue
        merged.append((cache, dtype))
    return merged


def _names(index: int, caches: list[tuple[RankCache, torch.dtype]]) -> list[str]:
    """``model.layers.N`` for a layer with one cache, else one name per mixer (and part, when a mixer has two)."""
    base = f"model.layers.{index}"
    if len(caches) == 1 and caches[0][0].packing is None:
        return [base]
    mixers = [cache.mixer for cache, _ in caches]
    return [
        f"{base}.{cache.mixer}" if mixers.count(cache.mixer) == 1
        else f"{base}.{cache.mixer}.{cache.part.replace('/', '').replace('+', '_')}"
        for cache, _ in caches
    ]


def _num_blocks(params: EngineParams, plans: list[_LayerPlan], per_sequence_extra: int) -> int:
    """Blocks per layer tensor: what --memory leaves after the states and images, or what --tokens needs."""
    token_bytes = sum(plan.cache.spec.bytes_per_token(plan.slot_bytes) for plan in plans)
    state_bytes = sum(plan.cache.spec.bytes_per_sequence(plan.slot_bytes) for plan in plans) + per_sequence_extra
    budget = params.memory_bytes
    if budget is not None and token_bytes:
        blocks = (budget - state_bytes * params.seqs) // (token_bytes * params.block_size)
        if blocks < 1:
            raise KVGroupsError(
                f"--memory {params.memory_gib} GiB holds not even one block of {params.block_size} tokens "
                f"({token_bytes * params.block_size} B per rank) after {state_bytes * params.seqs} B of "
                f"recurrent state and images"
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
    geometry = dataclasses.replace(plan.geometry, num_blocks=num_blocks)
    shape = shape_for(plan.layout, geometry)
    if plan.layout.tensors_per_layer == 2:  # a (k, v) pair: the values' tensor in their own head size
        values = (*shape[:-1], geometry.value_head_size or geometry.head_size)
        return tuple(torch.empty(each, dtype=plan.dtype, device="meta") for each in (shape, values))
    return torch.empty(shape, dtype=plan.dtype, device="meta")


def _cross_attention(image_caches: list[tuple[int, RankCache]], dtypes: CacheDtypes,
                     params: EngineParams) -> CrossAttention | None:
    if not image_caches:
        return None
    shapes = {(cache.num_kv_heads, cache.head_size, cache.tokens_per_image) for _, cache in image_caches}
    if len(shapes) != 1:
        raise KVGroupsError(f"cross-attention layers differ in heads, head size or image tokens: {sorted(shapes)}")
    (heads, head_size, tokens_per_image), = shapes
    return CrossAttention(
        model_layers=tuple(index for index, _ in image_caches), num_kv_heads=heads, head_size=head_size,
        dtype=dtypes.kv, tokens_per_image=params.image_tokens or tokens_per_image or 0, images=params.images,
    )


def build_rank(spec: ModelSpec, model_name: str, params: EngineParams) -> RankBuild:
    """The caches of rank ``params.rank`` of ``spec`` on the meta device, grouped and described."""
    dtypes = resolve_dtypes(spec, kv=params.kv_dtype, state=params.state_dtype,
                            conv_state=params.conv_state_dtype, ssm_state=params.ssm_state_dtype)
    layer_caches = [layer.rank_caches(params.tp, index) for index, layer in enumerate(spec.layers)]
    layout = params.layout
    if layout is None:
        diff_kv = any(cache.value_head_size is not None for caches in layer_caches for cache in caches)
        layout = DIFF_KV_LAYOUT if diff_kv else DEFAULT_LAYOUT
    plans: list[_LayerPlan] = []
    image_caches: list[tuple[int, RankCache]] = []
    layers_with_cache = 0
    for index, caches in enumerate(layer_caches):
        layers_with_cache += bool(caches)
        image_caches += [(index, cache) for cache in caches if cache.tokens_per_image is not None]
        text = _merged(tuple(cache for cache in caches if cache.tokens_per_image is None), dtypes)
        plans += [_plan(name, index, cache, dtype, params, layout, dtypes.kv)
                  for name, (cache, dtype) in zip(_names(index, text), text, strict=True)]
    if not plans:
        raise KVGroupsError(f"model {model_name!r} has no layer that keeps a cache")
    cross = _cross_attention(image_caches, dtypes, params)
    num_blocks = _num_blocks(params, plans, cross.bytes_per_sequence if cross else 0)
    values = {plan.name: _layer_value(plan, num_blocks) for plan in plans}
    specs = {plan.name: plan.cache.spec for plan in plans}
    layouts = {plan.name: plan.layout for plan in plans if plan.cache.spec.token_indexed}
    value_head_sizes = {plan.name: plan.geometry.value_head_size for plan in plans
                        if plan.geometry.value_head_size is not None}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, specs, layout=layouts, value_head_size=value_head_sizes)
    metadata = LMCacheMetadata.for_groups(manager.kv_layer_groups, model_name=model_name, chunk_size=params.chunk_size,
                                          world_size=params.tp, worker_id=params.rank, kv_dtype=dtypes.kv)
    return RankBuild(
        metadata=metadata, layout=layout,
        model_layer_of={plan.name: plan.model_layer for plan in plans},
        pages_of={plan.name: plan.page for plan in plans if plan.page is not None},
        padded_values_of={plan.name: plan.cache.value_head_size for plan in plans
                          if plan.cache.value_head_size is not None and plan.geometry.value_head_size is None},
        holds_of={plan.name: plan.cache.holds for plan in plans},
        num_blocks=num_blocks, dtypes=dtypes, layers_with_cache=layers_with_cache, cross_attention=cross,
    )
