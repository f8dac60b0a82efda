"""Differential test against LMCache 0.4.1 on homogeneous models (skipped when not importable)."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

import kvgroups

reference_groups = pytest.importorskip("lmcache.v1.kv_layer_groups")
reference_metadata = pytest.importorskip("lmcache.v1.metadata")

CASES = 1000
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


def random_case(rng: random.Random) -> tuple[dict[str, torch.Tensor], bool, tuple[int, ...]]:
    """A homogeneous model: all layers K/V (flash-attn or FlashInfer order) or all MLA."""
    family = rng.choice(("flash_attn", "flashinfer", "mla"))
    num_blocks = rng.choice((1, 3, 7, 64)) if family == "flashinfer" else rng.choice((1, 2, 3, 64))
    block_size = rng.choice((1, 16, 64))
    variants = []
    for _ in range(rng.randint(1, 4)):
        heads, head_size = rng.choice((1, 2, 8)), rng.choice((64, 128, 576))
        dtype = rng.choice(DTYPES)
        if family == "flash_attn":
            shape: tuple[int, ...] = (2, num_blocks, block_size, heads, head_size)
        elif family == "flashinfer":
            shape = (num_blocks, 2, block_size, heads, head_size)
        else:
            shape = (num_blocks, block_size, head_size)
        variants.append((shape, dtype))
    names = [f"model.layers.{i}.attn" for i in range(rng.randint(0, 40))]
    rng.shuffle(names)  # indices follow dict order, not the numbers in the names
    caches = {}
    for name in names:
        shape, dtype = rng.choice(variants)
        caches[name] = torch.empty(shape, dtype=dtype, device="meta")
    use_mla = family == "mla"
    kv_shape = (max(len(names), 1), 1 if use_mla else 2, 256, 1 if use_mla else 8, 128)
    return caches, use_mla, kv_shape


def describe(manager: Any) -> list[tuple[Any, ...]]:
    return [
        (list(g.layer_names), list(g.layer_indices), tuple(g.shape), g.dtype, g.num_layers, g.hidden_dim_size)
        for g in manager.kv_layer_groups
    ]


def test_matches_lmcache_on_random_homogeneous_models() -> None:
    logging.getLogger("lmcache").setLevel(logging.WARNING)
    rng = random.Random(20261129)
    for case in range(CASES):
        caches, use_mla, kv_shape = random_case(rng)
        ours = kvgroups.LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, kv_shape, use_mla=use_mla)
        theirs = reference_metadata.LMCacheMetadata(
            "m", 1, 1, 0, 0, torch.bfloat16, kv_shape, use_mla=use_mla
        )
        # Before building, both fall back to kv_shape.
        assert ours.get_shapes() == theirs.get_shapes(), case
        ours.kv_layer_groups_manager.build_kv_layer_groups(caches)
        theirs.kv_layer_groups_manager.build_kv_layer_groups(caches)
        mine, ref = ours.kv_layer_groups_manager, theirs.kv_layer_groups_manager
        assert describe(mine) == describe(ref), case
        assert mine.num_groups == ref.num_groups
        probes = [*range(-1, len(caches) + 2)]
        for index in probes:
            expected = ref.get_group_by_layer_idx(index)
            found = mine.get_group_by_layer_idx(index)
            assert (found is None) == (expected is None), (case, index)
            if expected is not None:
                assert found is not None and found.layer_indices == expected.layer_indices
            assert mine.get_layer_shape(index) == ref.get_layer_shape(index)
            assert mine.get_layer_dtype(index) == ref.get_layer_dtype(index)
        for name in [*caches, "missing"]:
            expected = ref.get_group_by_layer_name(name)
            found = mine.get_group_by_layer_name(name)
            assert (found is None) == (expected is None), (case, name)
            if expected is not None:
                assert found is not None and found.layer_names == expected.layer_names
        num_tokens = rng.choice((None, 0, 1, 255, 256, 1000))
        assert ours.get_shapes(num_tokens) == theirs.get_shapes(num_tokens), case
        assert ours.get_dtypes() == theirs.get_dtypes(), case
        assert ours.get_num_groups() == theirs.get_num_groups(), case
