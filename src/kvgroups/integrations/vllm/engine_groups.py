"""vLLM's KV-cache groups as kvgroups groups: what each layer's cache is, and which blocks it uses.

vLLM (0.32) describes its caches with a ``KVCacheConfig``: KV-cache groups, each a list of layer
names and one spec, whose requests get one list of block ids per group. :class:`EnginePlan`
reads that once, on both sides of the connector: the scheduler builds groups from ``meta``
tensors of the shapes vLLM allocates, the worker from the tensors it registers, and both must
arrive at the same groups (the same fingerprint), which the worker checks. kvgroups groups never
span two vLLM groups, even of equal specs, because each vLLM group has its own block table.

A layer's value is what kvgroups moves: an attention layer's ``[num_blocks, num_heads,
block_size, 2 * head_size]`` view as it is (layout ``VLLM``, or ``VLLM_CPU`` / ``VLLM_CPU_AMX`` as
the CPU backend's kernels pack its pages; ``head_size +
head_size_v`` where values have a head size of their own, MiMo-V2's diff-KV pages, which only
vLLM's GPU backends write); an MLA layer's
``[num_blocks, 1, block_size, head_size]`` view without its head axis (layout ``MLA``); a mamba
layer's int8 page ``[num_blocks, 1, 1, page_bytes]`` as the state tensors the mixer itself slices
from it, or as the bytes of those states when they differ in dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvgroups.core.cache_specs import (
    ChunkedLocal,
    FullAttention,
    LayerCacheSpec,
    MLAttention,
    RecurrentState,
    SlidingWindow,
)
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.layouts import CacheGeometry, KVLayout, shape_for
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.errors import KVGroupsError, UnsupportedCacheError
from kvgroups.integrations.vllm.packed_pages import packed_page_kind, page_bytes, page_view, with_layer_pages
from kvgroups.integrations.vllm.refused_specs import refusal


@dataclass(frozen=True)
class LayerPlan:
    """One layer's cache as kvgroups sees it: its spec, layout, dtype and sizes.

    Attention: ``num_heads`` x ``head_size`` per token, values ``value_head_size`` where they
    differ (None: ``head_size``). Mamba: ``page_shapes`` / ``page_dtypes``
    are the states vLLM packs into each page, in order; ``states_as_bytes`` moves them as one
    uint8 state when their dtypes differ.
    """

    name: str
    spec: LayerCacheSpec
    layout: KVLayout
    dtype: torch.dtype
    num_heads: int = 1
    head_size: int = 1
    page_shapes: tuple[tuple[int, ...], ...] = ()
    page_dtypes: tuple[torch.dtype, ...] = ()
    states_as_bytes: bool = False
    value_head_size: int | None = None
    page_bytes: int = 0  # moved by page (:mod:`.packed_pages`): one slot per block of this many bytes

    @property
    def token_indexed(self) -> bool:
        return self.spec.token_indexed

    def meta_value(self, num_blocks: int, block_size: int) -> Any:
        """What :meth:`value` makes of the tensor vLLM allocates, on the ``meta`` device."""
        if not self.token_indexed:
            return tuple(torch.empty(num_blocks, *shape, dtype=self.dtype, device="meta")
                         for shape in self.spec.state_shapes)
        if self.page_bytes:
            return torch.empty(num_blocks, 1, self.page_bytes, dtype=torch.uint8, device="meta")
        if self.layout is KVLayout.MLA:
            return torch.empty(num_blocks, block_size, self.head_size, dtype=self.dtype, device="meta")
        sizes = CacheGeometry(kv_size=2, num_blocks=num_blocks, block_size=block_size, num_heads=self.num_heads,
                              head_size=self.head_size, value_head_size=self.value_head_size)
        return torch.empty(shape_for(self.layout, sizes), dtype=self.dtype, device="meta")

    def value(self, tensor: Any) -> Any:
        """The tensor vLLM registered for this layer as the value kvgroups moves (views, never copies)."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shown = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise KVGroupsError(f"layer {self.name!r}: vLLM registered {shown}; expected a 4-D cache view")
        if self.page_bytes:
            return page_view(self.name, tensor, self.page_bytes)
        if self.token_indexed:
            if self.layout is KVLayout.MLA:
                if tensor.shape[1] != 1:
                    raise KVGroupsError(f"layer {self.name!r}: an MLA cache is [num_blocks, 1, block_size, "
                                        f"head_size]; vLLM registered {list(tensor.shape)}")
                return tensor.squeeze(1)
            return tensor
        if tensor.dtype != torch.int8 or tuple(tensor.shape[1:3]) != (1, 1):
            raise KVGroupsError(f"layer {self.name!r}: a mamba page is int8 [num_blocks, 1, 1, page_bytes]; "
                                f"vLLM registered {tensor.dtype} {list(tensor.shape)}")
        pages = tensor.squeeze(2).squeeze(1)
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(self.page_shapes, self.page_dtypes,
                                                                          strict=True)]
        if sum(sizes) > pages.shape[1]:
            raise KVGroupsError(f"layer {self.name!r}: its states take {sum(sizes)} bytes, its pages "
                                f"{pages.shape[1]}")
        if self.states_as_bytes:
            return (pages[:, :sum(sizes)].view(torch.uint8),)
        states, offset = [], 0
        for shape, dtype, size in zip(self.page_shapes, self.page_dtypes, sizes, strict=True):
            states.append(pages[:, offset:offset + size].view(dtype).view(-1, *shape))
            offset += size
        return tuple(states)


# vLLM's mamba_cache_mode values the connector restores states in: "none" (vLLM's prefix caching off),
# one state block per request updated in place; "align" (prefix caching on, vLLM's default), a block
# table on the block grid whose block p holds the state after (p + 1) * block_size tokens.
STATE_MODES = ("none", "align")


@dataclass(frozen=True)
class EngineGroup:
    """One vLLM KV-cache group: its block size, the layers kvgroups moves, its kvgroups groups."""

    index: int
    block_size: int  # tokens per block id, as the scheduler counts them
    layer_names: tuple[str, ...]
    # Positions of its kvgroups groups in the deployment's group list; set by EnginePlan.build_groups.
    members: tuple[int, ...]
    token_indexed: bool
    state_mode: str | None  # mamba_cache_mode of a recurrent group

    @property
    def states_on_block_grid(self) -> bool:
        """A recurrent group whose states vLLM keeps on its block grid (``mamba_cache_mode`` "align")."""
        return self.state_mode == "align"

    def state_block(self, block_ids: Sequence[int], num_tokens: int) -> int:
        """The block of a recurrent group that holds (or is to hold) the state after ``num_tokens`` tokens.

        In "none" mode a request has one state block, updated in place; in "align" mode the block at
        ``num_tokens // block_size - 1``, which is where vLLM reads a hit's state from (its model
        runner continues from block ``(num_computed_tokens - 1) // block_size``) and where it keeps
        the state of a step that ends there.
        """
        if self.state_mode == "none":
            if len(block_ids) != 1 or block_ids[0] == 0:
                raise KVGroupsError(f"recurrent KV-cache group {self.index}: its blocks are {list(block_ids)}; "
                                    f"expected its one state block (mamba_cache_mode 'none')")
            return int(block_ids[0])
        if self.state_mode != "align":
            raise KVGroupsError(f"recurrent KV-cache group {self.index}: mamba_cache_mode {self.state_mode!r} "
                                f"keeps states where the connector cannot find them (known: {', '.join(STATE_MODES)})")
        index = num_tokens // self.block_size - 1
        if num_tokens % self.block_size or not 0 <= index < len(block_ids) or block_ids[index] == 0:
            shown = int(block_ids[index]) if 0 <= index < len(block_ids) else "none"
            raise KVGroupsError(
                f"recurrent KV-cache group {self.index} (mamba_cache_mode 'align', blocks of {self.block_size} "
                f"tokens): no state block after {num_tokens} tokens (block {index} of {len(block_ids)} is {shown})")
        return int(block_ids[index])


def natural_key(name: str) -> tuple[Any, ...]:
    """``model.layers.10.attn`` after ``model.layers.9.attn``: numbers compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def engine_layout(is_cpu: bool) -> KVLayout:
    """The layout of vLLM's attention caches: the CPU backend's pages, else the GPU backends' views.

    On the CPU each layer's pages are then those of the kernels vLLM picks for it (:func:`cpu_page_layout`)."""
    return KVLayout.VLLM_CPU if is_cpu else KVLayout.VLLM


def cpu_page_layout(spec: AttentionSpec) -> KVLayout:
    """How vLLM's CPU backend packs this attention layer's pages: as its ``amx`` kernels do, or its
    ``vec`` / ``vec16`` ones.

    vLLM 0.32 and 0.33 (``cpu_attn._get_attn_isa``) pick ``vec16`` for head sizes that are a
    multiple of 16 but not of 32, else ``amx`` for bfloat16 with block sizes that are a multiple of
    32 on a CPU with AMX tiles. vLLM reads the model's dtype there, the spec holds the cache's: the
    two differ only for an fp8 cache, whose amx pages are another layout, refused by
    :func:`~kvgroups.integrations.vllm.backends.check_backends` (it compares every layer's kernels
    with this choice at registration).
    """
    vec16 = spec.head_size % 32 != 0 and spec.head_size % 16 == 0
    if (not vec16 and spec.dtype == torch.bfloat16 and spec.block_size % 32 == 0
            and torch.cpu._is_amx_tile_supported()):
        return KVLayout.VLLM_CPU_AMX
    return KVLayout.VLLM_CPU


def _token_kind(name: str, spec: AttentionSpec) -> LayerCacheSpec:
    if type(spec) is SlidingWindowSpec:
        return SlidingWindow(window_tokens=spec.sliding_window)
    if type(spec) is ChunkedLocalAttentionSpec:
        return ChunkedLocal(chunk_tokens=spec.attention_chunk_size)
    if type(spec) is FullAttentionSpec:
        # Without the hybrid allocator vLLM keeps every token of a sliding or chunked layer in a
        # full-attention group; the layer still reads only its window.
        if spec.sliding_window is not None:
            return SlidingWindow(window_tokens=spec.sliding_window)
        if spec.attention_chunk_size is not None:
            return ChunkedLocal(chunk_tokens=spec.attention_chunk_size)
        return FullAttention()
    raise UnsupportedCacheError(f"layer {name!r}: {type(spec).__name__} caches are not supported "
                                f"(supported: full, sliding-window, chunked-local and MLA attention, mamba)")


def layer_plan(name: str, spec: Any, layout: KVLayout) -> LayerPlan:
    """How kvgroups stores layer ``name`` whose vLLM spec is ``spec``; raises for what it cannot restore."""
    paged = packed_page_kind(name, spec)
    if paged is not None:
        return LayerPlan(name, paged, KVLayout.MLA, torch.uint8, head_size=page_bytes(spec),
                         page_bytes=page_bytes(spec))
    reason = refusal(spec)
    if reason is not None:
        raise UnsupportedCacheError(f"layer {name!r}: {type(spec).__name__}: {reason}")
    if isinstance(spec, MambaSpec):
        shapes = tuple(tuple(int(dim) for dim in shape) for shape in spec.shapes)
        dtypes = tuple(spec.dtypes)
        if len(set(dtypes)) == 1:
            return LayerPlan(name, RecurrentState(state_shapes=shapes), KVLayout.RECURRENT, dtypes[0],
                             page_shapes=shapes, page_dtypes=dtypes)
        content = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True))
        return LayerPlan(name, RecurrentState(state_shapes=((content,),)), KVLayout.RECURRENT, torch.uint8,
                         page_shapes=shapes, page_dtypes=dtypes, states_as_bytes=True)
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedCacheError(f"layer {name!r}: {type(spec).__name__} caches are not supported")
    problems = []
    # An MLA page holds one latent row per token (vLLM says: values of 0 elements); others K then V,
    # of their own head sizes in a diff-KV page (K rows of head_size, then V rows of head_size_v).
    is_mla = isinstance(spec, MLAAttentionSpec)
    value_head_size = None if is_mla or spec.head_size_v == spec.head_size else int(spec.head_size_v)
    if is_mla and spec.head_size_v != 0:
        problems.append(f"an MLA spec with values of {spec.head_size_v} elements")
    if value_head_size is not None and not layout.holds_value_head_size:
        problems.append(f"values of {spec.head_size_v} elements per head differ from keys of {spec.head_size}, and "
                        f"layout {layout.value} has no such pages (vLLM's CPU backend splits each page in two "
                        f"halves of one head size; diff-KV attention runs on its GPU backends)")
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        problems.append(f"KV quantization {spec.kv_quant_mode.name} keeps scales outside the page")
    if getattr(spec, "topk_buffer_width", None) is not None:  # vLLM 0.33's sparse MLA
        problems.append("its sparse top-k indices buffer is kept beside the page")
    if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
        problems.append("its pages are packed by the backend (head slots)")
    if getattr(spec, "kv_head_major_slots", False):  # vLLM 0.34
        problems.append("kv_head_major_slots: its page slots are grouped by KV head (H2ND), not the layout "
                        "kvgroups reads")
    # A token's K/V in a layer after a non-causal one depends on tokens after it: no prefix stands alone.
    if getattr(spec, "non_causal", False):
        problems.append("non_causal: its attention reads tokens after each one, so a prefix's K/V depends on what "
                        "follows it")
    if getattr(spec, "non_causal_multi_token_decode", False):  # on MLA specs from vLLM 0.34
        problems.append("non_causal_multi_token_decode: its decode rows attend to tokens after them, so a "
                        "prefix's K/V depends on what follows it")
    if problems:
        raise UnsupportedCacheError(f"layer {name!r} ({type(spec).__name__}): " + "; ".join(problems))
    if is_mla:
        if type(spec) is not MLAAttentionSpec:
            raise UnsupportedCacheError(f"layer {name!r}: {type(spec).__name__} caches are not supported")
        return LayerPlan(name, MLAttention(), KVLayout.MLA, spec.dtype, head_size=spec.head_size)
    if layout is KVLayout.VLLM_CPU:
        layout = cpu_page_layout(spec)
    return LayerPlan(name, _token_kind(name, spec), layout, spec.dtype, num_heads=spec.num_kv_heads,
                     head_size=spec.head_size, value_head_size=value_head_size)


class EnginePlan:
    """vLLM's KV-cache groups read once: per layer a :class:`LayerPlan`, per vLLM group an :class:`EngineGroup`.

    Layers that only alias another layer's cache (vLLM's cross-layer KV sharing: in a group, but
    in no cache tensor) are left out: their bytes are their target's. Raises
    :class:`UnsupportedCacheError` for caches the connector cannot restore exactly, naming the
    layer and why.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, layout: KVLayout, vllm_config: Any = None) -> None:
        allocated = {name for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers}
        every_layer = [name for group in kv_cache_config.kv_cache_groups for name in group.layer_names]
        self.layer_index = {name: index for index, name in enumerate(sorted(set(every_layer), key=natural_key))}
        self.layers: dict[str, LayerPlan] = {}
        self.engine_groups: list[EngineGroup] = []
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(group, "enable_kv_transfer", True):
                raise UnsupportedCacheError(
                    f"KV-cache group {index} (layers {list(group.layer_names)[:3]}...) takes no part in KV "
                    f"transfer; a prefix restored without it would be wrong"
                )
            spec = group.kv_cache_spec
            names = tuple(name for name in group.layer_names if not allocated or name in allocated)
            for name in names:
                layer_spec = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
                self.layers[name] = layer_plan(name, layer_spec, layout)
            token_indexed = all(self.layers[name].token_indexed for name in names)
            if not token_indexed and any(self.layers[name].token_indexed for name in names):
                raise UnsupportedCacheError(f"KV-cache group {index} mixes attention and state layers")
            self.engine_groups.append(EngineGroup(
                index=index, block_size=int(spec.block_size), layer_names=names, members=(),
                token_indexed=token_indexed,
                state_mode=None if token_indexed else str(getattr(spec, "mamba_cache_mode", "none")),
            ))
        self.layers = with_layer_pages(self.layers, kv_cache_config.kv_cache_groups, vllm_config)

    def build_groups(self, values: Mapping[str, Any]) -> tuple[list[KVLayerGroupInfo], list[EngineGroup]]:
        """kvgroups groups of ``values`` (layer name -> value), within each vLLM group, and the vLLM
        groups with their ``members`` (positions of their kvgroups groups in the list) set."""
        groups: list[KVLayerGroupInfo] = []
        engine_groups = []
        for engine_group in self.engine_groups:
            names = engine_group.layer_names
            if not names:
                engine_groups.append(engine_group)
                continue
            manager = KVLayerGroupsManager()
            value_head_sizes = {name: size for name in names
                                if (size := self.layers[name].value_head_size) is not None}
            manager.build_kv_layer_groups(
                {name: values[name] for name in names},
                {name: self.layers[name].spec for name in names},
                layout={name: self.layers[name].layout for name in names},
                value_head_size=value_head_sizes,
            )
            first = len(groups)
            for group in manager.kv_layer_groups:
                groups.append(KVLayerGroupInfo(
                    list(group.layer_names), [self.layer_index[name] for name in group.layer_names],
                    group.shape, group.dtype, group.layout, group.spec, value_head_size=group.value_head_size,
                ))
            engine_groups.append(replace(engine_group, members=tuple(range(first, len(groups)))))
        return groups, engine_groups

    def meta_values(self, num_blocks: int) -> dict[str, Any]:
        """Every layer's value as ``meta`` tensors of the shapes vLLM allocates."""
        block_sizes = {name: group.block_size for group in self.engine_groups for name in group.layer_names}
        return {name: plan.meta_value(num_blocks, block_sizes[name]) for name, plan in self.layers.items()}
