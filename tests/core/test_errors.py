"""Every bad input raises ValueError/TypeError naming the culprit and what was expected."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvgroups import (
    CompressedRows,
    FullAttention,
    KVGroupsError,
    KVLayerGroupInfo,
    KVLayerGroupsManager,
    KVLayout,
    LMCacheMetadata,
    MLAttention,
    RecurrentState,
    SlidingWindow,
    StaleGroupsError,
)
from tests.support.helpers import meta


def build(caches: dict[str, Any], **kwargs: Any) -> KVLayerGroupsManager:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, **kwargs)
    return manager


def test_non_tensor_values_are_listed() -> None:
    with pytest.raises(TypeError, match=r"layer 1 'b'.*ndarray|layer 1 'b'.*list") as error:
        build({"a": meta(2, 4, 16, 2, 8), "b": [1, 2, 3], "c": "cache"})
    assert "layer 2 'c'" in str(error.value) and "str" in str(error.value)


def test_pair_of_non_tensors() -> None:
    with pytest.raises(TypeError, match=r"layer 0 'kv'"):
        build({"kv": (meta(4, 16, 2, 8), None)})


@pytest.mark.parametrize("shape", [(4, 16, 8), (2, 4, 16, 2), (3, 4, 16, 2, 8), (2, 4, 16, 2, 8, 1)])
def test_unsupported_rank_or_shape(shape: tuple[int, ...]) -> None:
    caches = {"ok": meta(2, 4, 16, 2, 8), "bad": meta(*shape)}
    if len(shape) == 3:
        caches["bad"] = meta(*shape[:2])  # rank 2
    with pytest.raises(KVGroupsError, match=r"layer 1 'bad'.*cannot tell the layout") as error:
        build(caches)
    assert isinstance(error.value, ValueError)


def test_explicit_layout_with_wrong_rank_or_kv_axis() -> None:
    with pytest.raises(KVGroupsError, match=r"layer 0 'x'.*rank 4 .*flash_attn_hnd"):
        build({"x": meta(4, 16, 2, 8)}, layout=KVLayout.FLASH_ATTN_HND)
    with pytest.raises(KVGroupsError, match=r"layer 0 'x'.*needs 2 at the K/V axis \(dim 1\)"):
        build({"x": meta(4, 3, 16, 2, 8)}, layout=KVLayout.FLASHINFER)


def test_kv_pair_that_differs() -> None:
    # Values of another head size than keys are a pair of their own (MiMo-V2); any other difference is refused.
    k, v = meta(4, 16, 2, 8), meta(4, 16, 3, 8)
    with pytest.raises(KVGroupsError, match=r"layer 0 'l0'.*K Tensor\[4, 16, 2, 8\].*V Tensor\[4, 16, 3, 8\]"):
        build({"l0": (k, v)})
    assert build({"l0": (k, meta(4, 16, 2, 16))}).kv_layer_groups[0].value_head_size == 16
    with pytest.raises(KVGroupsError, match=r"'l0'.*differ"):
        build({"l0": (k, meta(4, 16, 2, 8, dtype=torch.float16))})


def test_caches_on_different_devices() -> None:
    caches = {"a": meta(2, 4, 16, 2, 8), "b": torch.zeros(2, 4, 16, 2, 8, dtype=torch.bfloat16)}
    with pytest.raises(KVGroupsError, match=r"one device.*meta: layers 0.*cpu: layers 1"):
        build(caches)


def test_group_with_duplicate_names_or_indices() -> None:
    shape = torch.Size([2, 4, 16, 2, 8])
    with pytest.raises(KVGroupsError, match=r"duplicate names \['a'\]"):
        KVLayerGroupInfo(["a", "a"], [0, 1], shape, torch.float16)
    with pytest.raises(KVGroupsError, match=r"duplicate indices \[3\]"):
        KVLayerGroupInfo(["a", "b"], [3, 3], shape, torch.float16)


def test_group_with_mismatched_lengths() -> None:
    with pytest.raises(KVGroupsError, match=r"len\(layer_names\)=2 != len\(layer_indices\)=1"):
        KVLayerGroupInfo(["a", "b"], [0], torch.Size([2, 4, 16, 2, 8]), torch.float16)


def test_group_with_bad_types() -> None:
    with pytest.raises(TypeError, match=r"offending indices \[-1\]"):
        KVLayerGroupInfo(["a"], [-1], torch.Size([2, 4, 16, 2, 8]), torch.float16)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype, got 'float16'"):
        KVLayerGroupInfo(["a"], [0], torch.Size([2, 4, 16, 2, 8]), "float16")  # type: ignore[arg-type]
    with pytest.raises(KVGroupsError, match=r"cannot tell the layout of shape \[4, 16, 2, 8\]"):
        KVLayerGroupInfo(["a"], [0], torch.Size([4, 16, 2, 8]), torch.float16)


def test_spec_that_does_not_fit_the_layout() -> None:
    with pytest.raises(KVGroupsError, match=r"layer 0 'l0'.*mla layer cannot be stored in layout flash_attn"):
        build({"l0": meta(2, 4, 16, 2, 8)}, layer_specs={"l0": MLAttention()})
    with pytest.raises(KVGroupsError, match=r"'c'.*compressed layer cannot be stored in layout flash_attn"):
        build({"c": meta(2, 4, 16, 2, 8)}, layer_specs={"c": CompressedRows(tokens_per_row=4)})
    # A window of single rows (DeepSeek-V4's K=V head, a compressor's state) is an MLA-layout cache.
    [group] = build({"m": meta(4, 16, 8)}, layer_specs={"m": SlidingWindow(window_tokens=4)}).kv_layer_groups
    assert (group.kind.value, group.layout) == ("sliding_window", KVLayout.MLA)


def test_specs_for_unknown_layers_or_of_wrong_type() -> None:
    with pytest.raises(KVGroupsError, match=r"lacks: \['ghost'\]"):
        build({"l0": meta(2, 4, 16, 2, 8)}, layer_specs={"ghost": FullAttention()})
    with pytest.raises(TypeError, match=r"'l0': 'full'"):
        build({"l0": meta(2, 4, 16, 2, 8)}, layer_specs={"l0": "full"})
    with pytest.raises(TypeError, match=r"layout must be a KVLayout"):
        build({"l0": meta(2, 4, 16, 2, 8)}, layout="flash_attn")


def test_bad_spec_parameters() -> None:
    with pytest.raises(KVGroupsError, match=r"SlidingWindow.window_tokens must be a positive int, got 0"):
        SlidingWindow(window_tokens=0)
    with pytest.raises(KVGroupsError, match=r"state_shapes"):
        RecurrentState(state_shapes=())


def test_recurrent_states_that_do_not_match_the_spec() -> None:
    spec = RecurrentState(state_shapes=((6, 3), (2, 4, 8)))
    good = (meta(10, 6, 3), meta(10, 2, 4, 8))
    build({"m": good}, layer_specs={"m": spec})
    with pytest.raises(KVGroupsError, match=r"'m'.*state 1 is Tensor\[10, 2, 4, 9\].*\[num_state_slots, 2, 4, 8\]"):
        build({"m": (good[0], meta(10, 2, 4, 9))}, layer_specs={"m": spec})
    with pytest.raises(KVGroupsError, match=r"'m'.*1 state tensors given, the spec lists 2"):
        build({"m": good[0]}, layer_specs={"m": spec})
    with pytest.raises(KVGroupsError, match=r"'m'.*differs from state 0"):
        build({"m": (good[0], meta(9, 2, 4, 8))}, layer_specs={"m": spec})


def test_different_grouping_on_rebuild_is_stale_unless_rebuild() -> None:
    manager = build({"a": meta(2, 4, 16, 2, 8)})
    with pytest.raises(StaleGroupsError, match=r"rebuild=True"):
        manager.build_kv_layer_groups({"a": meta(2, 8, 16, 2, 8)})
    manager.build_kv_layer_groups({"a": meta(2, 8, 16, 2, 8)}, rebuild=True)
    assert manager.kv_layer_groups[0].num_blocks == 8


def test_kv_layer_groups_must_be_a_list() -> None:
    with pytest.raises(TypeError, match=r"kv_layer_groups must be a list"):
        KVLayerGroupsManager(kv_layer_groups=(1, 2))  # type: ignore[arg-type]


BASE: dict[str, Any] = dict(
    model_name="m", world_size=4, local_world_size=2, worker_id=3, local_worker_id=1,
    kv_dtype=torch.bfloat16, kv_shape=(32, 2, 256, 8, 128),
)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"world_size": 0}, r"world_size must be an int >= 1, got 0"),
        ({"worker_id": 4}, r"worker_id must be an int in \[0, world_size=4\), got 4"),
        ({"worker_id": -1}, r"worker_id must be an int in \[0, world_size=4\), got -1"),
        ({"local_world_size": 0}, r"local_world_size must be an int >= 1, got 0"),
        ({"local_worker_id": 2}, r"local_worker_id must be an int in \[0, local_world_size=2\), got 2"),
        ({"chunk_size": 0}, r"chunk_size must be an int >= 1, got 0"),
        ({"kv_shape": (32, 2, 256, 8)}, r"kv_shape must be 5 positive ints .* got \(32, 2, 256, 8\)"),
        ({"kv_shape": (32, 2, 0, 8, 128)}, r"kv_shape must be 5 positive ints"),
        ({"kv_shape": (32, 3, 256, 8, 128)}, r"kv_shape\[1\] \(kv_size\) is 3 but use_mla=False needs 2"),
        ({"kv_shape": (32, 1, 256, 8, 128)}, r"kv_shape\[1\] \(kv_size\) is 1 but use_mla=False needs 2"),
        ({"use_mla": True}, r"kv_shape\[1\] \(kv_size\) is 2 but use_mla=True needs 1"),
        ({"kv_dtype": "bfloat16"}, r"kv_dtype must be a torch.dtype, got 'bfloat16'"),
    ],
)
def test_bad_metadata(changes: dict[str, Any], pattern: str) -> None:
    with pytest.raises(KVGroupsError, match=pattern):
        LMCacheMetadata(**{**BASE, **changes})


def test_negative_num_tokens() -> None:
    with pytest.raises(KVGroupsError, match=r"num_tokens must be an int >= 0, got -1"):
        LMCacheMetadata(**BASE).get_shapes(-1)


def test_use_mla_that_contradicts_the_groups_raises_when_the_groups_are_built() -> None:
    metadata = LMCacheMetadata(**{**BASE, "use_mla": True, "kv_shape": (32, 1, 256, 1, 576)})
    with pytest.raises(KVGroupsError, match=r"use_mla=True but no group holds an MLA cache \(groups \[0\]"):
        metadata.kv_layer_groups_manager.build_kv_layer_groups({"l0": meta(2, 4, 16, 2, 8)})
    assert metadata.kv_layer_groups_manager.kv_layer_groups == []  # the contradicting groups were not kept
    metadata = LMCacheMetadata(**BASE)
    with pytest.raises(KVGroupsError, match=r"use_mla=False but groups \[1\] hold MLA caches"):
        metadata.kv_layer_groups_manager.build_kv_layer_groups({"l0": meta(2, 4, 16, 2, 8), "l1": meta(4, 16, 8)})
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({"l0": meta(4, 16, 8)})
    with pytest.raises(KVGroupsError, match=r"use_mla=False but groups \[0\] hold MLA caches"):
        LMCacheMetadata(**BASE, kv_layer_groups_manager=manager)
    with pytest.raises(KVGroupsError, match=r"use_mla=False but groups \[0\] hold MLA caches"):
        metadata.kv_layer_groups_manager.kv_layer_groups = list(manager.kv_layer_groups)
