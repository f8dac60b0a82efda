"""Every engine layout reads back the right sizes, on meta tensors, including HND views."""

from __future__ import annotations

import pytest
import torch

from kvgroups import (
    CacheGeometry,
    KVGroupsError,
    KVLayerGroupsManager,
    KVLayout,
    LMCacheMetadata,
    MLAttention,
    SlidingWindow,
    detect_layout,
    geometry,
)
from kvgroups.core.layouts import shape_for, to_token_major
from tests.support.helpers import meta

NB, BS, NH, HS = 7, 16, 4, 32
EXPECTED = CacheGeometry(kv_size=2, num_blocks=NB, block_size=BS, num_heads=NH, head_size=HS)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (KVLayout.FLASH_ATTN, (2, NB, BS, NH, HS)),
        (KVLayout.FLASH_ATTN_HND, (2, NB, NH, BS, HS)),
        (KVLayout.FLASHINFER, (NB, 2, BS, NH, HS)),
        (KVLayout.FLASHINFER_HND, (NB, 2, NH, BS, HS)),
        (KVLayout.KV_SPLIT, (NB, BS, NH, HS)),
        (KVLayout.KV_SPLIT_HND, (NB, NH, BS, HS)),
        (KVLayout.VLLM, (NB, NH, BS, 2 * HS)),
        (KVLayout.VLLM_CPU, (NB, NH, BS, 2 * HS)),
    ],
)
def test_geometry_of_every_kv_layout(layout: KVLayout, shape: tuple[int, ...]) -> None:
    assert geometry(layout, shape) == EXPECTED
    assert EXPECTED.hidden_dim_size == NH * HS
    assert shape_for(layout, EXPECTED) == torch.Size(shape)


def test_geometry_of_mla() -> None:
    sizes = geometry(KVLayout.MLA, (NB, BS, 576))
    assert sizes == CacheGeometry(kv_size=1, num_blocks=NB, block_size=BS, num_heads=1, head_size=576)
    assert sizes.hidden_dim_size == 576


def test_detect_layout() -> None:
    assert detect_layout(meta(2, NB, BS, NH, HS)) is KVLayout.FLASH_ATTN
    assert detect_layout(meta(NB, 2, BS, NH, HS)) is KVLayout.FLASHINFER
    assert detect_layout(meta(NB, BS, HS)) is KVLayout.MLA
    assert detect_layout((meta(NB, BS, NH, HS), meta(NB, BS, NH, HS))) is KVLayout.KV_SPLIT
    # num_blocks == 2 in FlashInfer order is read as LMCache reads it: dim 0 is K/V.
    assert detect_layout(meta(2, 2, BS, NH, HS)) is KVLayout.FLASH_ATTN
    assert detect_layout(meta(NB, 3, BS, NH, HS)) is None
    assert detect_layout(meta(NB, BS, NH, HS)) is None


def test_hnd_group_from_a_permuted_view_of_nhd_storage() -> None:
    storage = torch.zeros(NB, 2, BS, NH, HS)
    hnd_view = storage.permute(0, 1, 3, 2, 4)
    assert not hnd_view.is_contiguous()
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({"l0": hnd_view}, layout=KVLayout.FLASHINFER_HND)
    (group,) = manager.kv_layer_groups
    assert group.layout is KVLayout.FLASHINFER_HND
    assert (group.num_blocks, group.block_size, group.num_heads, group.head_size) == (NB, BS, NH, HS)
    # LMCache reads shape[3] * shape[4] = block_size * head_size here; we must not.
    assert group.hidden_dim_size == NH * HS != BS * HS


def test_to_token_major_writes_through_to_the_cache() -> None:
    storage = torch.zeros(NB, 2, NH, BS, HS)
    view = to_token_major(KVLayout.FLASHINFER_HND, storage, kv_index=1)
    assert view.shape == (NB, BS, NH, HS)
    view[3, 5, 2, 7] = 42.0
    assert storage[3, 1, 2, 5, 7] == 42.0
    mla = torch.zeros(NB, BS, 8)
    to_token_major(KVLayout.MLA, mla, kv_index=0)[1, 2, 0, 3] = 1.0
    assert mla[1, 2, 3] == 1.0


def test_kv_split_pairs_group_on_their_per_tensor_shape() -> None:
    manager = KVLayerGroupsManager()
    pair = (meta(NB, BS, NH, HS), meta(NB, BS, NH, HS))
    manager.build_kv_layer_groups({"l0": pair, "l1": list(pair)})
    (group,) = manager.kv_layer_groups
    assert group.layout is KVLayout.KV_SPLIT and group.shape == (NB, BS, NH, HS)
    assert group.kv_size == 2 and group.hidden_dim_size == NH * HS


def test_explicit_layout_overrides_detection_per_layer() -> None:
    manager = KVLayerGroupsManager()
    caches = {"a": meta(2, NB, NH, BS, HS), "b": meta(2, NB, BS, NH, HS)}
    manager.build_kv_layer_groups(caches, layout={"a": KVLayout.FLASH_ATTN_HND})
    assert [g.layout for g in manager.kv_layer_groups] == [KVLayout.FLASH_ATTN_HND, KVLayout.FLASH_ATTN]
    assert [g.hidden_dim_size for g in manager.kv_layer_groups] == [NH * HS, NH * HS]


def test_kinds_split_lookalike_layers_and_set_per_group_kv_size() -> None:
    caches = {f"l{i}": meta(2, NB, BS, NH, HS) for i in range(4)}
    caches["mla"] = meta(NB, BS, 576)
    specs = {"l1": SlidingWindow(window_tokens=128), "l3": SlidingWindow(window_tokens=128)}
    metadata = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (5, 1, 256, 1, 576), use_mla=True)
    metadata.kv_layer_groups_manager.build_kv_layer_groups(caches, specs)
    groups = metadata.kv_layer_groups_manager.kv_layer_groups
    assert [g.layer_indices for g in groups] == [[0, 2], [1, 3], [4]]
    assert [g.kind.value for g in groups] == ["full_attention", "sliding_window", "mla"]
    assert groups[1].spec == SlidingWindow(window_tokens=128)
    assert groups[2].spec == MLAttention()
    assert metadata.get_shapes(8) == [
        torch.Size([2, 2, 8, NH * HS]), torch.Size([2, 2, 8, NH * HS]), torch.Size([1, 1, 8, 576])
    ]


def test_vllm_pages_need_an_explicit_layout_and_cpu_pages_must_be_contiguous() -> None:
    page = meta(NB, NH, BS, 2 * HS)
    assert detect_layout(page) is None  # VLLM and VLLM_CPU differ only inside a page
    manager = KVLayerGroupsManager()
    with pytest.raises(KVGroupsError, match=r"pass layout= .*vllm, vllm_cpu"):
        manager.build_kv_layer_groups({"l0": page})
    manager.build_kv_layer_groups({"l0": page}, layout=KVLayout.VLLM_CPU)
    (group,) = manager.kv_layer_groups
    assert (group.num_heads, group.block_size, group.head_size, group.hidden_dim_size) == (NH, BS, HS, NH * HS)
    # Tokens outside heads (vLLM's NHD order) is a VLLM view, never a CPU page.
    nhd = torch.empty(NB, BS, NH, 2 * HS, device="meta").permute(0, 2, 1, 3)
    KVLayerGroupsManager().build_kv_layer_groups({"l0": nhd}, layout=KVLayout.VLLM)
    with pytest.raises(KVGroupsError, match=r"layer 0 'l0'.*vllm_cpu.*page of 16 x 64 elements contiguous"):
        KVLayerGroupsManager().build_kv_layer_groups({"l0": nhd}, layout=KVLayout.VLLM_CPU)
    with pytest.raises(KVGroupsError, match=r"even"):
        KVLayerGroupsManager().build_kv_layer_groups({"l0": meta(NB, NH, BS, 7)}, layout=KVLayout.VLLM)


def test_cpu_page_planes_are_views_of_the_page_bytes() -> None:
    cache = torch.arange(2 * NH * BS * 2 * HS, dtype=torch.float32).view(2, NH, BS, 2 * HS)
    keys, values = (to_token_major(KVLayout.VLLM_CPU, cache, plane) for plane in (0, 1))
    page = cache[1, 3].flatten()  # block 1, head 3
    assert torch.equal(keys[1, 5, 3], page[torch.arange(HS) * BS + 5])
    assert torch.equal(values[1, 5, 3], page[BS * HS + 5 * HS: BS * HS + 6 * HS])
    keys[1, 5, 3, 0] = -1.0
    assert cache[1, 3].flatten()[5] == -1.0


def test_amx_pages_are_bfloat16_in_groups_of_16_tokens_and_16_head_elements() -> None:
    """vLLM's amx kernels pack each page as AMX tiles: the page must be contiguous, 2-byte elements,
    block and head sizes multiples of 16; each offender is named."""
    def build(*shape: int, dtype: torch.dtype = torch.bfloat16) -> None:
        page = torch.empty(*shape, dtype=dtype, device="meta")
        KVLayerGroupsManager().build_kv_layer_groups({"l0": page}, layout=KVLayout.VLLM_CPU_AMX)

    build(NB, NH, 32, 2 * 64)
    build(NB, NH, 16, 2 * 16, dtype=torch.float16)
    with pytest.raises(KVGroupsError, match=r"layer 0 'l0'.*2 bytes \(bfloat16\), not torch.float32"):
        build(NB, NH, 32, 2 * 64, dtype=torch.float32)
    with pytest.raises(KVGroupsError, match=r"multiples of 16; got block size 8, head size 64"):
        build(NB, NH, 8, 2 * 64)
    with pytest.raises(KVGroupsError, match=r"multiples of 16; got block size 32, head size 40"):
        build(NB, NH, 32, 2 * 40)
    nhd = torch.empty(NB, 32, NH, 2 * 64, dtype=torch.bfloat16, device="meta").permute(0, 2, 1, 3)
    with pytest.raises(KVGroupsError, match=r"page of 32 x 128 elements contiguous"):
        KVLayerGroupsManager().build_kv_layer_groups({"l0": nhd}, layout=KVLayout.VLLM_CPU_AMX)
    with pytest.raises(KVGroupsError, match=r"no token-major view"):
        to_token_major(KVLayout.VLLM_CPU_AMX, torch.empty(NB, NH, 32, 2 * 64, dtype=torch.bfloat16), 0)


def test_amx_page_planes_place_each_element_where_vllms_amx_kernels_write_it() -> None:
    """Element d of token t: keys at (t // 16) * 16 * H + (d // 2) * 32 + (t % 16) * 2 + d % 2 of the
    page, values at N * H + (d // 16) * 16 * N + (t // 2) * 32 + (d % 16) * 2 + t % 2 (vLLM's
    csrc/cpu/cpu_attn_amx.hpp, reshape_and_cache), and writes land in the page."""
    from kvgroups.core.cpu_pages import amx_page_plane

    num_blocks, num_heads, block_size, head_size = 2, 3, 32, 48
    cache = torch.arange(num_blocks * num_heads * block_size * 2 * head_size, dtype=torch.float32)
    cache = cache.view(num_blocks, num_heads, block_size, 2 * head_size)
    keys, values = (amx_page_plane(cache, plane) for plane in (0, 1))
    assert (keys.tokens_per_group, values.tokens_per_group) == (16, 2)
    page = cache[1, 2].flatten()
    for t in (0, 1, 15, 16, 17, 31):
        d = torch.arange(head_size)
        key_places = (t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2
        value_places = block_size * head_size + (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2
        key = keys.view[1, t // 16, t % 16, 2].flatten()
        value = values.view[1, t // 2, t % 2, 2].flatten()
        assert torch.equal(key, page[key_places]) and torch.equal(value, page[value_places])
    every = torch.cat([keys.view.flatten(), values.view.flatten()]).sort().values
    assert torch.equal(every, cache.flatten())  # the two planes cover every element of the pages once
    values.view[1, 3, 1, 2, 2, 5] = -1.0  # token 7, element 37 of head 2 in block 1
    assert page[block_size * head_size + 2 * 16 * block_size + 3 * 32 + 5 * 2 + 1] == -1.0
