"""The batched-copy path's triples, applied by ``memmove`` on the CPU, move the bytes the torch path does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvgroups import KVLayerGroupsManager, KVLayout
from kvgroups.datapath.address_tables import token_tables
from kvgroups.datapath.copy_triples import apply_on_host, supports, token_triples
from kvgroups.datapath.descriptors import RUN_WORDS
from kvgroups.datapath.run_queue import RunQueue
from kvgroups.transfer import KVTransfer

BLOCK, BLOCKS = 16, 24


def caches(layout: KVLayout, seed: int) -> tuple[dict[str, Any], KVLayerGroupsManager]:
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(torch.bfloat16)

    values: dict[str, Any] = {}
    for index in range(3):
        if layout is KVLayout.FLASH_ATTN:
            values[f"layers.{index}"] = random(2, BLOCKS, BLOCK, 4, 32)
        elif layout is KVLayout.MLA:
            values[f"layers.{index}"] = random(BLOCKS, BLOCK, 72)
        else:  # vLLM's NHD pages with K and V interleaved in the last axis: a token's K is not next token's K
            values[f"layers.{index}"] = random(BLOCKS, BLOCK, 4, 64).permute(0, 2, 1, 3)
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, layout=dict.fromkeys(values, layout))
    return values, manager


def runs_of(queue_slots: list[np.ndarray], chunks: list[torch.Tensor]) -> np.ndarray:
    queue = RunQueue(BLOCK)
    for slots, chunk in zip(queue_slots, chunks, strict=True):
        queue.add(chunk, slots.size, slots)
    runs = np.zeros((queue.num_runs, RUN_WORDS), dtype=np.int64)
    queue.write(runs)
    return runs


@pytest.mark.parametrize("layout", [KVLayout.FLASH_ATTN, KVLayout.MLA], ids=lambda layout: layout.name)
def test_triples_applied_by_memmove_equal_the_torch_path(layout: KVLayout) -> None:
    values, manager = caches(layout, 0)
    group = manager.kv_layer_groups[0]
    layers = [(values[name],) for name in group.layer_names]
    tables = token_tables(group.layout, layers)
    assert tables is not None and supports(tables)
    generator = np.random.default_rng(0)
    aligned = (generator.permutation(np.arange(1, BLOCKS))[:3, None] * BLOCK + np.arange(BLOCK)).reshape(-1)
    calls = [aligned.astype(np.int64), generator.permutation(BLOCKS * BLOCK)[:11].astype(np.int64)]
    chunks = [torch.zeros(group.slots_shape(slots.size), dtype=group.dtype) for slots in calls]
    runs = runs_of(calls, chunks)
    assert runs.shape[0] == 3 + 11  # a run per block of the aligned call, per token of the other
    sources, targets, sizes = token_triples(tables, BLOCK, runs, scatter=False)
    planes = group.kv_size * len(group.layer_names)
    # A FlashAttention page's block-aligned run is one triple of 16 rows of every head: 16 x 4 x 32 x 2 bytes.
    assert sizes.size == planes * runs.shape[0] and sizes.max() == BLOCK * group.hidden_dim_size * 2
    apply_on_host(sources, targets, sizes)
    reference = KVTransfer(manager, values, kernel="torch")
    for slots, chunk in zip(calls, chunks, strict=True):
        (expected,) = reference.pack(torch.from_numpy(slots))
        assert torch.equal(chunk.view(torch.uint8), expected.view(torch.uint8))

    # Scattered back into other caches: the bytes the torch path writes there.
    targets_values, _ = caches(layout, 1)
    expected_values, _ = caches(layout, 1)
    into = token_tables(group.layout, [(targets_values[name],) for name in group.layer_names])
    assert into is not None
    apply_on_host(*token_triples(into, BLOCK, runs_of(calls, chunks), scatter=True))
    writer = KVTransfer(manager, expected_values, kernel="torch")
    for slots, chunk in zip(calls, chunks, strict=True):
        writer.unpack([chunk], torch.from_numpy(slots))
    for name in group.layer_names:
        assert torch.equal(targets_values[name].view(torch.uint8), expected_values[name].view(torch.uint8))


def test_rows_spread_in_the_cache_are_left_to_the_kernel() -> None:
    values, manager = caches(KVLayout.VLLM, 0)
    group = manager.kv_layer_groups[0]
    tables = token_tables(group.layout, [(values[name],) for name in group.layer_names])
    assert tables is not None and not supports(tables)
    with pytest.raises(ValueError, match="use the kernel"):
        token_triples(tables, BLOCK, np.zeros((1, RUN_WORDS), dtype=np.int64), scatter=False)
