"""Code written against LMCache's seed-era API runs unchanged on kvgroups."""

from __future__ import annotations

import torch

from kvgroups import KVLayerGroupInfo, KVLayerGroupsManager, LMCacheMetadata
from tests.support.helpers import meta


def _mixed() -> dict[str, torch.Tensor]:
    return {
        "layer_0": meta(2, 32, 16, 8, 64, dtype=torch.float16),
        "layer_1": meta(2, 32, 16, 8, 64, dtype=torch.float32),
        "layer_2": meta(2, 32, 16, 16, 64, dtype=torch.float16),
        "layer_3": meta(2, 32, 16, 8, 64, dtype=torch.float16),
    }


def test_empty_dict_builds_no_groups() -> None:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({})
    assert manager.kv_layer_groups == []
    assert manager.num_groups == 0
    assert manager.get_group_by_layer_idx(0) is None
    assert manager.get_layer_shape(0) is None
    assert manager.get_layer_dtype(0) is None


def test_groups_by_shape_and_dtype_in_first_index_order() -> None:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(_mixed())
    assert [g.layer_names for g in manager.kv_layer_groups] == [
        ["layer_0", "layer_3"], ["layer_1"], ["layer_2"]
    ]
    assert [g.layer_indices for g in manager.kv_layer_groups] == [[0, 3], [1], [2]]
    assert manager.kv_layer_groups[0].shape == (2, 32, 16, 8, 64)
    assert manager.kv_layer_groups[1].dtype == torch.float32
    assert manager.kv_layer_groups[2].hidden_dim_size == 16 * 64
    assert manager.kv_layer_groups[0].num_layers == 2


def test_layer_index_is_dict_position_not_name() -> None:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({"layer_2": meta(2, 4, 16, 8, 64), "layer_0": meta(2, 4, 16, 8, 64)})
    (group,) = manager.kv_layer_groups
    assert group.layer_names == ["layer_2", "layer_0"]
    assert group.layer_indices == [0, 1]


def test_lookups_survive_in_place_sort_and_reassignment() -> None:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(_mixed())
    manager.kv_layer_groups.sort(key=lambda g: -g.layer_indices[0])
    assert manager.kv_layer_groups[0].layer_indices == [2]
    assert manager.get_group_by_layer_idx(2) is manager.kv_layer_groups[0]
    removed = manager.kv_layer_groups.pop(0)
    assert manager.get_group_by_layer_idx(2) is None
    assert manager.get_group_by_layer_name("layer_2") is None
    manager.kv_layer_groups = [removed]
    assert manager.get_group_by_layer_name("layer_2") is removed
    assert manager.get_group_by_layer_idx(0) is None
    manager.kv_layer_groups[0] = KVLayerGroupInfo(["x"], [7], torch.Size([4, 16, 576]), torch.bfloat16)
    assert manager.get_group_by_layer_idx(7).layer_names == ["x"]  # type: ignore[union-attr]
    assert manager.get_group_by_layer_idx(2) is None


def test_lookups_see_edits_of_a_groups_layer_lists() -> None:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(_mixed())
    group = manager.kv_layer_groups[1]
    group.layer_indices.append(9)
    group.layer_names.append("extra")
    assert group.contains_layer(9)
    assert group.contains_layer_name("extra")
    assert manager.get_group_by_layer_idx(9) is group
    assert manager.get_group_by_layer_name("extra") is group
    group.layer_indices = [5]
    assert not group.contains_layer(1)
    assert manager.get_group_by_layer_idx(5) is group
    assert manager.get_group_by_layer_idx(1) is None


def test_contains_layer() -> None:
    group = KVLayerGroupInfo(["a", "b"], [0, 4], torch.Size([2, 8, 16, 4, 32]), torch.float16)
    assert group.contains_layer(4) and not group.contains_layer(1)
    assert group.contains_layer_name("a") and not group.contains_layer_name("c")
    assert group.hidden_dim_size == 128


def test_building_twice_with_same_caches_is_a_noop() -> None:
    manager = KVLayerGroupsManager()
    caches = _mixed()
    manager.build_kv_layer_groups(caches)
    before = manager.kv_layer_groups
    manager.build_kv_layer_groups(caches)
    assert manager.kv_layer_groups is before


def test_metadata_without_groups() -> None:
    metadata = LMCacheMetadata(
        model_name="m", world_size=2, local_world_size=2, worker_id=1, local_worker_id=1,
        kv_dtype=torch.bfloat16, kv_shape=(32, 2, 256, 8, 128),
    )
    assert not metadata.is_first_rank()
    assert metadata.first_rank == 0
    assert metadata.get_dtypes() == [torch.bfloat16]
    assert metadata.get_shapes() == [torch.Size([2, 32, 256, 1024])]
    assert metadata.get_shapes(10) == [torch.Size([2, 32, 10, 1024])]
    assert metadata.get_num_groups() == 1
    assert metadata.role is None and metadata.served_model_name is None
    assert metadata.chunk_size == 256 and metadata.engine_id is None
    assert metadata.kv_connector_extra_config is None


def test_metadata_with_groups() -> None:
    metadata = LMCacheMetadata("m", 1, 1, 0, 0, torch.float16, (4, 2, 256, 8, 64))
    metadata.kv_layer_groups_manager.build_kv_layer_groups(_mixed())
    assert metadata.is_first_rank()
    assert metadata.get_num_groups() == 3
    assert metadata.get_dtypes() == [torch.float16, torch.float32, torch.float16]
    assert metadata.get_shapes(16) == [
        torch.Size([2, 2, 16, 512]), torch.Size([2, 1, 16, 512]), torch.Size([2, 1, 16, 1024])
    ]


def test_mla_metadata() -> None:
    metadata = LMCacheMetadata("ds", 1, 1, 0, 0, torch.bfloat16, (61, 1, 256, 1, 576), use_mla=True)
    metadata.kv_layer_groups_manager.build_kv_layer_groups(
        {f"l{i}": meta(64, 16, 576) for i in range(61)}
    )
    assert metadata.get_shapes() == [torch.Size([1, 61, 256, 576])]
