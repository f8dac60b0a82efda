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
from tests.helpers import meta

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
