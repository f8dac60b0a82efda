"""Property tests of grouping, lookups, serialization and fingerprints over random layer sets."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups import (
    CacheGeometry,
    ChunkedLocal,
    FullAttention,
    KVLayerGroupsManager,
    KVLayout,
    LayerCacheSpec,
    LMCacheMetadata,
    MLAttention,
    RecurrentState,
    SlidingWindow,
    detect_layout,
)
from kvgroups.core.layouts import shape_for

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
KV_LAYOUTS = (
    KVLayout.FLASH_ATTN, KVLayout.FLASH_ATTN_HND, KVLayout.FLASHINFER, KVLayout.FLASHINFER_HND,
    KVLayout.KV_SPLIT, KVLayout.KV_SPLIT_HND, KVLayout.VLLM, KVLayout.VLLM_CPU,
)


@dataclass(frozen=True)
class Template:
    """What one layer looks like: the test's own description, independent of the library."""

    layout: KVLayout
    sizes: CacheGeometry
    dtype: torch.dtype
    spec: LayerCacheSpec

    def value(self) -> Any:
        if isinstance(self.spec, RecurrentState):
            return tuple(
                torch.empty(self.sizes.num_blocks, *shape, dtype=self.dtype, device="meta")
                for shape in self.spec.state_shapes
            )
        shape = shape_for(self.layout, self.sizes)
        tensor = torch.empty(shape, dtype=self.dtype, device="meta")
        if self.layout.tensors_per_layer == 2:
            return (tensor, torch.empty(shape, dtype=self.dtype, device="meta"))
        return tensor

    def key(self) -> tuple[Any, ...]:
        if isinstance(self.spec, RecurrentState):
            elements = sum(int(torch.Size(s).numel()) for s in self.spec.state_shapes)
            return ((self.sizes.num_blocks, elements), self.dtype, self.layout, self.spec)
        return (tuple(shape_for(self.layout, self.sizes)), self.dtype, self.layout, self.spec)


@st.composite
def templates(draw: st.DrawFn) -> Template:
    dtype = draw(st.sampled_from(DTYPES))
    num_blocks = draw(st.sampled_from((1, 2, 3, 5)))
    block_size = draw(st.sampled_from((1, 4, 16)))
    choice = draw(st.sampled_from(("kv", "mla", "recurrent")))
    if choice == "mla":
        sizes = CacheGeometry(kv_size=1, num_blocks=num_blocks, block_size=block_size, num_heads=1,
                              head_size=draw(st.sampled_from((8, 576))))
        return Template(KVLayout.MLA, sizes, dtype, MLAttention())
    if choice == "recurrent":
        shapes = tuple(
            tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
            for _ in range(draw(st.integers(1, 2)))
        )
        sizes = CacheGeometry(kv_size=1, num_blocks=num_blocks, block_size=1, num_heads=1, head_size=1)
        return Template(KVLayout.RECURRENT, sizes, dtype, RecurrentState(state_shapes=shapes))
    sizes = CacheGeometry(kv_size=2, num_blocks=num_blocks, block_size=block_size,
                          num_heads=draw(st.sampled_from((1, 2, 8))), head_size=draw(st.sampled_from((8, 64))))
    spec = draw(st.sampled_from((
        FullAttention(), SlidingWindow(window_tokens=128), SlidingWindow(window_tokens=4096),
        ChunkedLocal(chunk_tokens=8192),
    )))
    return Template(draw(st.sampled_from(KV_LAYOUTS)), sizes, dtype, spec)


@st.composite
def models(draw: st.DrawFn) -> list[tuple[str, Template]]:
    pool = draw(st.lists(templates(), min_size=1, max_size=4))
    count = draw(st.integers(0, 24))
    names = draw(st.permutations([f"layers.{i}" for i in range(count)]))
    return [(name, draw(st.sampled_from(pool))) for name in names]


def build(model: list[tuple[str, Template]]) -> KVLayerGroupsManager:
    caches = {name: template.value() for name, template in model}
    # Pass a layout only where detection cannot know it, so detection is exercised too.
    layouts = {
        name: template.layout for name, template in model
        if not isinstance(template.spec, RecurrentState) and detect_layout(caches[name]) is not template.layout
    }
    specs = {
        name: template.spec for name, template in model
        if not isinstance(template.spec, (FullAttention, MLAttention))
    }
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, specs, layout=layouts)
    return manager


@settings(max_examples=150, deadline=None)
@given(models())
def test_grouping_matches_a_brute_force_partition(model: list[tuple[str, Template]]) -> None:
    manager = build(model)
    seen: list[int] = []
    for group in manager.kv_layer_groups:
        seen.extend(group.layer_indices)
        assert group.layer_indices == sorted(group.layer_indices)
        keys = {model[index][1].key() for index in group.layer_indices}
        assert keys == {(tuple(group.shape), group.dtype, group.layout, group.spec)}
        assert [model[index][0] for index in group.layer_indices] == group.layer_names
    assert sorted(seen) == list(range(len(model)))  # every layer in exactly one group
    firsts = [group.layer_indices[0] for group in manager.kv_layer_groups]
    assert firsts == sorted(firsts)
    assert len({tuple(map(repr, g.key.__dict__.values())) for g in manager.kv_layer_groups}) == manager.num_groups
    # lookups agree with a linear scan, also after the caller reorders the list
    manager.kv_layer_groups.reverse()
    for index, (name, template) in enumerate(model):
        scan = next(g for g in manager.kv_layer_groups if index in g.layer_indices)
        assert manager.get_group_by_layer_idx(index) is scan
        assert manager.get_group_by_layer_name(name) is scan
        assert scan.hidden_dim_size == (
            template.spec.state_elements if isinstance(template.spec, RecurrentState)
            else template.sizes.num_heads * template.sizes.head_size
        )
    assert manager.get_group_by_layer_idx(len(model)) is None


@settings(max_examples=100, deadline=None)
@given(models())
def test_serialization_round_trips(model: list[tuple[str, Template]]) -> None:
    manager = build(model)
    restored = KVLayerGroupsManager.from_json(manager.to_json())
    assert restored == manager
    assert json.loads(restored.to_json()) == manager.to_dict()
    has_mla = any(g.layout is KVLayout.MLA for g in manager.kv_layer_groups)
    metadata = LMCacheMetadata(
        "org/model", 2, 2, 1, 1, torch.bfloat16, (max(len(model), 1), 1 if has_mla else 2, 64, 4, 32),
        use_mla=has_mla, chunk_size=64, kv_layer_groups_manager=manager, engine_id="e",
        kv_connector_extra_config={"port": 5555, "nested": {"a": [1, 2]}}, role="worker",
    )
    again = LMCacheMetadata.from_json(metadata.to_json())
    assert again == metadata
    assert again.fingerprint() == metadata.fingerprint()
    assert again.get_shapes(7) == metadata.get_shapes(7)


FORMAT_FIELDS = ("model_name", "world_size", "worker_id", "chunk_size", "dtype", "layout", "spec", "heads")
OTHER_FIELDS = ("num_blocks", "engine_id", "role", "extra_config", "local_worker_id")


@dataclass(frozen=True)
class Config:
    model_name: str = "m"
    world_size: int = 2
    worker_id: int = 0
    chunk_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    layout: KVLayout = KVLayout.FLASH_ATTN
    spec: LayerCacheSpec = FullAttention()  # noqa: RUF009 - frozen, shared safely
    heads: tuple[int, int] = (4, 32)  # (num_heads, head_size): 4x32 and 2x64 share a hidden size
    num_blocks: int = 8
    engine_id: str | None = None
    role: str | None = None
    extra_config: int = 0
    local_worker_id: int = 0

    def format_key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in FORMAT_FIELDS)

    def metadata(self) -> LMCacheMetadata:
        sizes = CacheGeometry(kv_size=2, num_blocks=self.num_blocks, block_size=4,
                              num_heads=self.heads[0], head_size=self.heads[1])
        template = Template(self.layout, sizes, self.dtype, self.spec)
        metadata = LMCacheMetadata(
            self.model_name, self.world_size, 2, self.worker_id, self.local_worker_id, self.dtype,
            (3, 2, self.chunk_size, 4, 32), chunk_size=self.chunk_size, engine_id=self.engine_id,
            role=self.role, kv_connector_extra_config={"port": self.extra_config},
        )
        metadata.kv_layer_groups_manager = build([(f"l{i}", template) for i in range(3)])
        return metadata


configs = st.builds(
    Config,
    model_name=st.sampled_from(("m", "n")),
    world_size=st.sampled_from((2, 4)),
    worker_id=st.sampled_from((0, 1)),
    chunk_size=st.sampled_from((16, 256)),
    dtype=st.sampled_from((torch.bfloat16, torch.float16)),
    layout=st.sampled_from((KVLayout.FLASH_ATTN, KVLayout.FLASHINFER_HND)),
    spec=st.sampled_from((FullAttention(), SlidingWindow(window_tokens=128))),
    heads=st.sampled_from(((4, 32), (2, 64))),
    num_blocks=st.sampled_from((8, 9)),
    engine_id=st.sampled_from((None, "a")),
    role=st.sampled_from((None, "worker")),
    extra_config=st.sampled_from((0, 1)),
    local_worker_id=st.sampled_from((0, 1)),
)


@settings(max_examples=300, deadline=None)
@given(configs, configs)
def test_fingerprints_equal_iff_chunk_format_equal(first: Config, second: Config) -> None:
    same_format = first.format_key() == second.format_key()
    assert (first.metadata().fingerprint() == second.metadata().fingerprint()) == same_format
