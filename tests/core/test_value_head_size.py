"""Keys and values of different head sizes (MiMo-V2-Flash: 192 / 128): grouped, described, moved and
stored as the engine lays them out, with no padding, for every kernel."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups import (
    KVGroupsError,
    KVLayerGroupInfo,
    KVLayerGroupsManager,
    KVLayout,
    LMCacheMetadata,
    SlidingWindow,
)
from kvgroups.core.layouts import CacheGeometry, geometry, shape_for
from kvgroups.store import KVChunkStore
from kvgroups.transfer import KVTransfer

KERNELS = [
    pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} missing"))
    if name != "torch" else name
    for name in ("numba", "triton", "torch")
]
DIFF_LAYOUTS = (KVLayout.VLLM, KVLayout.KV_SPLIT, KVLayout.KV_SPLIT_HND)


def make_cache(layout: KVLayout, nb: int, bs: int, nh: int, keys: int, values: int, dtype: torch.dtype,
               permuted: bool, generator: torch.Generator) -> Any:
    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    if layout is KVLayout.VLLM:  # vLLM 0.32: [B, H, N, head_size + head_size_v], LBNHC or LBHNC
        return tensor(nb, bs, nh, keys + values).permute(0, 2, 1, 3) if permuted else tensor(nb, nh, bs, keys + values)
    if layout is KVLayout.KV_SPLIT:
        return tensor(nb, bs, nh, keys), tensor(nb, bs, nh, values)
    if permuted:
        return tensor(nb, bs, nh, keys).permute(0, 2, 1, 3), tensor(nb, bs, nh, values).permute(0, 2, 1, 3)
    return tensor(nb, nh, bs, keys), tensor(nb, nh, bs, values)


def read(layout: KVLayout, cache: Any, keys: int, plane: int, block: int, offset: int) -> torch.Tensor:
    """Token (block, offset)'s keys (plane 0) or values (plane 1), [heads, size], spelled out per layout."""
    if layout is KVLayout.VLLM:
        row = cache[block, :, offset]
        return row[:, :keys] if plane == 0 else row[:, keys:]
    if layout is KVLayout.KV_SPLIT:
        return cache[plane][block, offset]
    return cache[plane][block, :, offset]


def reference_pack(layout: KVLayout, caches: dict[str, Any], keys: int, slots: list[int], bs: int) -> torch.Tensor:
    """``[1, layers, tokens, heads * keys + heads * values]``: each row the token's keys, then its values."""
    layers = []
    for cache in caches.values():
        rows = [torch.cat([read(layout, cache, keys, plane, slot // bs, slot % bs).reshape(-1) for plane in (0, 1)])
                for slot in slots]
        layers.append(torch.stack(rows))
    return torch.stack(layers).unsqueeze(0)


def bits(value: Any) -> list[torch.Tensor]:
    return [tensor.contiguous().view(torch.uint8) for tensor in (value if isinstance(value, tuple) else (value,))]


def clone(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(clone(item) for item in value)
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    return copy.copy_(value)


def test_a_vllm_page_of_keys_then_values_has_its_own_value_head_size() -> None:
    cache = torch.empty(10, 4, 16, 192 + 128, dtype=torch.bfloat16, device="meta")
    group = KVLayerGroupInfo(["model.layers.0.attn"], [0], cache.shape, torch.bfloat16, KVLayout.VLLM,
                             value_head_size=128)
    assert (group.head_size, group.value_head_size, group.num_heads) == (192, 128, 4)
    assert (group.hidden_dim_size, group.value_hidden_dim_size) == (4 * 192, 4 * 128)
    assert group.bytes_per_token == 4 * (192 + 128) * 2
    assert group.chunk_shape(256) == torch.Size([1, 1, 256, 4 * 192 + 4 * 128])
    assert group.chunk_bytes(256) == 256 * 4 * 320 * 2
    assert "value_head_size=128" in repr(group)
    assert KVLayerGroupInfo.from_dict(group.to_dict()) == group
    assert geometry(KVLayout.VLLM, cache.shape, 128) == CacheGeometry(
        kv_size=2, num_blocks=10, block_size=16, num_heads=4, head_size=192, value_head_size=128)
    assert shape_for(KVLayout.VLLM, geometry(KVLayout.VLLM, cache.shape, 128)) == cache.shape


def test_equal_head_sizes_describe_and_fingerprint_as_before() -> None:
    cache = torch.empty(10, 4, 16, 256, dtype=torch.bfloat16, device="meta")
    told = KVLayerGroupInfo(["a"], [0], cache.shape, torch.bfloat16, KVLayout.VLLM, value_head_size=128)
    plain = KVLayerGroupInfo(["a"], [0], cache.shape, torch.bfloat16, KVLayout.VLLM)
    assert told == plain and told.value_head_size is None and "value_head_size" not in told.to_dict()
    fingerprints = {LMCacheMetadata.for_groups([group], model_name="m", chunk_size=256).fingerprint()
                    for group in (told, plain)}
    assert len(fingerprints) == 1
    diff = KVLayerGroupInfo(["a"], [0], cache.shape, torch.bfloat16, KVLayout.VLLM, value_head_size=96)
    assert LMCacheMetadata.for_groups([diff], model_name="m", chunk_size=256).fingerprint() not in fingerprints


@pytest.mark.parametrize("layout", [KVLayout.FLASH_ATTN, KVLayout.FLASHINFER_HND, KVLayout.VLLM_CPU, KVLayout.MLA])
def test_layouts_of_one_head_size_refuse_values_of_another(layout: KVLayout) -> None:
    shape = {KVLayout.FLASH_ATTN: (2, 4, 16, 2, 192), KVLayout.FLASHINFER_HND: (4, 2, 2, 16, 192),
             KVLayout.VLLM_CPU: (4, 2, 16, 320), KVLayout.MLA: (4, 16, 576)}[layout]
    with pytest.raises(KVGroupsError, match=rf"layout {layout.value} .*holds keys and values in one head size; "
                                            r"values of 128 need a layout that holds them unpadded \(kv_split, "
                                            r"kv_split_hnd, vllm\)"):
        KVLayerGroupInfo(["model.layers.3"], [3], shape, torch.bfloat16, layout, value_head_size=128)


def test_a_page_too_narrow_for_its_values_is_refused() -> None:
    with pytest.raises(KVGroupsError, match=r"a last axis of 128 cannot hold values of 128 after keys"):
        KVLayerGroupInfo(["x"], [0], (4, 2, 16, 128), torch.float16, KVLayout.VLLM, value_head_size=128)
    with pytest.raises(TypeError, match=r"value_head_size must be a positive int, a dict of them, or None; "
                                        r"offending 'b': 0"):
        KVLayerGroupsManager().build_kv_layer_groups(
            {"a": torch.empty(4, 2, 16, 64), "b": torch.empty(4, 2, 16, 64)}, layout=KVLayout.VLLM,
            value_head_size={"b": 0})


def test_groups_split_by_value_head_size_and_pairs_show_theirs() -> None:
    generator = torch.Generator().manual_seed(0)
    caches = {
        "layers.0": make_cache(KVLayout.VLLM, 4, 16, 4, 24, 16, torch.float16, False, generator),
        "layers.1": make_cache(KVLayout.VLLM, 4, 16, 4, 24, 16, torch.float16, False, generator),
        "layers.2": make_cache(KVLayout.VLLM, 4, 16, 4, 20, 20, torch.float16, False, generator),
    }
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, layout=KVLayout.VLLM, value_head_size={"layers.0": 16, "layers.1": 16})
    assert [(group.layer_names, group.head_size, group.value_head_size) for group in manager.kv_layer_groups] == [
        (["layers.0", "layers.1"], 24, 16), (["layers.2"], 20, None)]
    pairs = {"k.0": make_cache(KVLayout.KV_SPLIT_HND, 4, 16, 2, 24, 16, torch.float16, False, generator)}
    paired = KVLayerGroupsManager()
    paired.build_kv_layer_groups(pairs, layout=KVLayout.KV_SPLIT_HND)
    assert paired.kv_layer_groups[0].value_head_size == 16
    with pytest.raises(KVGroupsError, match=r"layer 0 'k.0': value_head_size=8 but the V tensor's head size is 16"):
        KVLayerGroupsManager().build_kv_layer_groups(pairs, layout=KVLayout.KV_SPLIT_HND, value_head_size=8)
    mismatched = {"k.0": (torch.empty(4, 2, 16, 24), torch.empty(4, 3, 16, 16))}
    with pytest.raises(KVGroupsError, match=r"must match in dtype, device and shape \(but for the head size\)"):
        KVLayerGroupsManager().build_kv_layer_groups(mismatched, layout=KVLayout.KV_SPLIT_HND)


@pytest.mark.parametrize("kernel", KERNELS)
def test_pack_and_unpack_move_keys_and_values_unpadded(kernel: str) -> None:
    # Triton runs interpreted here: fewer cases than the compiled kernels.
    settings(max_examples=12 if kernel == "triton" else 50, deadline=None)(given(data=st.data())(
        lambda data: check_pack_and_unpack(kernel, data)))()


def check_pack_and_unpack(kernel: str, data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(DIFF_LAYOUTS), label="layout")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]), label="dtype")
    nb, bs = data.draw(st.integers(2, 5), label="blocks"), data.draw(st.sampled_from([1, 4, 16]), label="bs")
    nh = data.draw(st.sampled_from([1, 2, 3]), label="heads")
    keys, values = data.draw(st.sampled_from([(24, 16), (8, 4), (16, 24), (6, 2)]), label="head sizes")
    num_layers = data.draw(st.integers(1, 3), label="layers")
    permuted = data.draw(st.booleans(), label="permuted")
    slots = data.draw(st.lists(st.integers(0, nb * bs - 1), min_size=1, max_size=nb * bs, unique=True), label="slots")
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    caches = {f"layers.{i}": make_cache(layout, nb, bs, nh, keys, values, dtype, permuted, generator)
              for i in range(num_layers)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, layout=layout, value_head_size=values if layout is KVLayout.VLLM else None)
    (group,) = manager.kv_layer_groups
    assert group.value_head_size == values
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    transfer = KVTransfer(manager, caches, kernel=kernel)
    assert transfer.kernels == [kernel]
    (chunk,) = transfer.pack(slot_mapping)
    expected = reference_pack(layout, caches, keys, slots, bs)
    assert chunk.shape == group.chunk_shape(len(slots)) == expected.shape
    assert torch.equal(chunk.view(torch.uint8), expected.view(torch.uint8))

    # Unpack into other caches: exactly the chunk's rows land, every other byte stays.
    targets = {name: make_cache(layout, nb, bs, nh, keys, values, dtype, permuted, generator) for name in caches}
    before = {name: clone(value) for name, value in targets.items()}
    KVTransfer(manager, targets, kernel=kernel).unpack([chunk], slot_mapping)
    expected_targets = {name: clone(value) for name, value in before.items()}
    for layer, cache in enumerate(expected_targets.values()):
        for token, slot in enumerate(slots):
            row = chunk[0, layer, token]
            for plane, (start, width) in enumerate(((0, nh * keys), (nh * keys, nh * values))):
                target = read(layout, cache, keys, plane, slot // bs, slot % bs)
                target.copy_(row[start:start + width].view(target.shape))
    for name in caches:
        assert all(torch.equal(a, b) for a, b in zip(bits(targets[name]), bits(expected_targets[name]), strict=True))


def test_a_sliding_window_group_of_mimo_shape_round_trips_through_the_store(tmp_path: Any) -> None:
    generator = torch.Generator().manual_seed(3)
    caches = {f"model.layers.{i}.self_attn.attn": make_cache(KVLayout.VLLM, 6, 16, 2, 24, 16, torch.bfloat16,
                                                              True, generator) for i in range(2)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {name: SlidingWindow(window_tokens=16) for name in caches},
                                  layout=KVLayout.VLLM, value_head_size=16)
    metadata = LMCacheMetadata.for_groups(manager.kv_layer_groups, model_name="mimo-like", chunk_size=32)
    slot_mapping = torch.arange(64, dtype=torch.int64)
    chunks = KVTransfer(manager, caches).pack(slot_mapping)
    assert [chunk.shape for chunk in chunks] == [torch.Size([1, 2, 64, 2 * 24 + 2 * 16])]
    store = KVChunkStore(metadata, f"file://{tmp_path}/kv")
    tokens = list(range(100, 164))
    for chunk_index in range(2):
        store.save(tokens, chunk_index, [chunks[0][:, :, chunk_index * 32:(chunk_index + 1) * 32].contiguous()])
    assert store.flush(timeout=30)
    loaded = store.load(tokens, 64)
    assert loaded.num_tokens == 64
    (prefix,) = loaded.groups
    # The window needs the last chunk only; its rows are exactly the packed ones, no padding stored.
    assert prefix.first_token == 32
    assert torch.equal(prefix.tensor.view(torch.uint8), chunks[0][:, :, 32:].contiguous().view(torch.uint8))
    store.close()
