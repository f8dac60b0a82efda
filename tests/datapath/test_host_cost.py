"""What one pack and one unpack call does on the host with the Triton kernels, the launch stubbed: counted.

The work is shaped as a GPU worker's: a chunk of block-aligned slots (and one of scattered slots) of
NHD pages, HND pages with values of their own head size, and recurrent states, copied to and from
chunks the kernel addresses directly. After warm-up a call runs no torch operation (so it allocates
no tensor, copies nothing to or from a device and synchronizes nothing), allocates no NumPy array of
the call's size, and launches each group's kernel exactly once, its runs written to the descriptor
ring. On a GPU two things differ, both outside these counts: a chunk in host memory is asked once
whether it is pinned (``aten::is_pinned``, a query), and a call that is not part of a batch records
one event for its descriptor runs.
"""

from __future__ import annotations

import importlib.util
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvgroups import KVLayerGroupsManager, KVLayout, RecurrentState
from kvgroups.datapath.descriptors import RUN_WORDS
from kvgroups.transfer import KVTransfer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton missing")
BLOCK = 16
BLOCKS = 320


class CountedOps(TorchDispatchMode):
    """Every aten operation run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def caches() -> tuple[dict[str, Any], KVLayerGroupsManager]:
    generator = torch.Generator().manual_seed(0)
    values: dict[str, Any] = {}
    layouts = {}
    value_heads = {}
    for index in range(2):
        values[f"nhd.{index}"] = torch.randn(2, BLOCKS, BLOCK, 2, 8, generator=generator).to(torch.bfloat16)
        layouts[f"nhd.{index}"] = KVLayout.FLASH_ATTN
        # vLLM's pages in HND strides, keys of 12 and values of 4 per head.
        values[f"hnd.{index}"] = torch.randn(BLOCKS, BLOCK, 2, 16, generator=generator).to(torch.bfloat16).permute(
            0, 2, 1, 3)
        layouts[f"hnd.{index}"] = KVLayout.VLLM
        value_heads[f"hnd.{index}"] = 4
    values["mamba.0"] = (torch.randn(4, 3, 5, generator=generator), torch.randn(4, 6, generator=generator))
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, {"mamba.0": RecurrentState(state_shapes=((3, 5), (6,)))}, layout=layouts,
                                  value_head_size=value_heads)
    return values, manager


def stubbed(transfer: KVTransfer) -> Counter[int]:
    """Replace every group's launch by a count of launches per group."""
    launches: Counter[int] = Counter()
    for index, copier in enumerate(transfer._copiers):
        def count(kernel: Any, grid: Any, arguments: Any, constants: Any, index: int = index) -> None:
            launches[index] += 1
        copier.launch = count  # type: ignore[union-attr]
    return launches


@contextmanager
def host_counts() -> Iterator[dict[str, Any]]:
    """Torch operations run inside, and the most memory the Python allocators held above the start."""
    counted: dict[str, Any] = {}
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with CountedOps() as mode:
            yield counted
        counted["ops"] = mode.ops
        counted["peak_bytes"] = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def block_aligned(count: int, generator: np.random.Generator) -> np.ndarray:
    blocks = generator.permutation(np.arange(1, BLOCKS))[:count // BLOCK]
    return (blocks[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1).astype(np.int64)


@pytest.mark.parametrize("aligned", [True, False], ids=["block-aligned", "scattered"])
def test_a_call_plans_with_numpy_alone_and_launches_once_per_group(aligned: bool) -> None:
    values, manager = caches()
    transfer = KVTransfer(manager, values, kernel="triton")
    launches = stubbed(transfer)
    generator = np.random.default_rng(1)
    tokens = 4096  # large enough that any array of the call's size stands out of the Python objects a call makes
    slots = block_aligned(tokens, generator) if aligned else generator.permutation(BLOCKS * BLOCK)[:tokens]
    # As the connector hands them: NumPy arrays (a CPU tensor's .numpy() is one aten::detach, an alias).
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    states = np.array([3, 1], dtype=np.int64)
    out = [torch.empty(group.slots_shape(tokens, 2), dtype=group.dtype) for group in manager.kv_layer_groups]
    for _ in range(2):  # warm-up: the first call of a size sizes the reused arrays
        transfer.pack(slots, state_indices=states, out=out, synchronize=False)
        transfer.unpack(out, slots, state_indices=states, synchronize=False)
    launches.clear()

    with host_counts() as packing:
        transfer.pack(slots, state_indices=states, out=out, synchronize=False)
    assert packing["ops"] == Counter()
    assert dict(launches) == {0: 1, 1: 1, 2: 1}
    with host_counts() as unpacking:
        transfer.unpack(out, slots, state_indices=states, synchronize=False)
    assert unpacking["ops"] == Counter()
    assert dict(launches) == {0: 2, 1: 2, 2: 2}
    # An array of the call's slots is 32 KiB: what a call holds at most besides is a few Python objects.
    assert packing["peak_bytes"] < tokens * 8 // 4, packing["peak_bytes"]
    assert unpacking["peak_bytes"] < tokens * 8 // 4, unpacking["peak_bytes"]

    # Block-aligned slots travel as one run per block, scattered ones as one per token.
    for index, group in enumerate(manager.kv_layer_groups):
        copier = transfer._copiers[index]
        ring = copier.ring  # type: ignore[union-attr]
        lease = ring.leases[-1]
        runs = ring.runs[lease.start:lease.end]
        if not group.token_indexed:
            assert runs[:, 0].tolist() == [3, 1] and runs[:, 4].tolist() == [0, 1]
            continue
        expected = slots[::BLOCK] if aligned else slots
        assert runs.shape == (expected.size, RUN_WORDS)
        assert runs[:, 0].tolist() == expected.tolist()
        assert set(runs[:, 1].tolist()) == {BLOCK if aligned else 1}
        assert set(runs[:, 2].tolist()) == {out[index].data_ptr()}


def test_one_launch_per_group_for_a_batch_of_calls_byte_exact() -> None:
    """Several chunks queued (``defer=True``) go in one launch per group, each to its own chunk, the bytes the
    torch path gives; unpacked likewise, with chunk rows chosen per slot."""
    values, manager = caches()
    transfer = KVTransfer(manager, values, kernel="triton")
    reference = KVTransfer(manager, values, kernel="torch")
    launches: Counter[int] = Counter()
    for index, copier in enumerate(transfer._copiers):
        real = copier.launch  # type: ignore[union-attr]

        def count(kernel: Any, grid: Any, arguments: Any, constants: Any, index: int = index, real: Any = real) -> None:
            launches[index] += 1
            real(kernel, grid, arguments, constants)
        copier.launch = count  # type: ignore[union-attr]
    generator = np.random.default_rng(2)
    calls = [(block_aligned(32, generator), [2]), (generator.permutation(BLOCKS * BLOCK)[:7].astype(np.int64), [0]),
             (block_aligned(16, generator)[3:], [3])]
    outs = []
    for slots, states in calls:
        out = [torch.empty(group.slots_shape(slots.size, 1), dtype=group.dtype) for group in manager.kv_layer_groups]
        transfer.pack(slots, state_indices=states, out=out, defer=True)
        outs.append(out)
    assert not launches
    transfer.launch(scatter=False).release(synchronize=True)
    assert dict(launches) == {0: 1, 1: 1, 2: 1}
    for (slots, states), out in zip(calls, outs, strict=True):
        expected = reference.pack(torch.from_numpy(slots), state_indices=states)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, expected, strict=True))

    # Unpacked into other caches in one launch per group: the first chunk's rows in reverse order, the others as
    # packed; then the caches hold what the torch path writes.
    targets, _ = caches()
    expected_caches, _ = caches()
    for value in (*targets.values(), *expected_caches.values()):
        for tensor in value if isinstance(value, tuple) else (value,):
            tensor.zero_()
    into = KVTransfer(manager, targets, kernel="triton")
    written = KVTransfer(manager, expected_caches, kernel="torch")
    for (slots, states), out in zip(calls, outs, strict=True):
        rows = np.arange(slots.size, dtype=np.int64)[::-1].copy() if slots is calls[0][0] else None
        into.unpack(out, slots, rows=rows, state_indices=states, defer=True)
        chunks = [chunk if rows is None or not group.token_indexed else chunk.index_select(2, torch.from_numpy(rows))
                  for chunk, group in zip(out, manager.kv_layer_groups, strict=True)]
        written.unpack(chunks, torch.from_numpy(slots), state_indices=states)
    into.launch(scatter=True).release(synchronize=True)
    for name, value in targets.items():
        wanted = expected_caches[name]
        for got, want in zip(value if isinstance(value, tuple) else (value,),
                             wanted if isinstance(wanted, tuple) else (wanted,), strict=True):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_a_launch_that_fails_leaves_nothing_queued_and_no_runs_leased() -> None:
    """A launch raising (a driver error) fails its call; the next call of the thread copies only its own chunks
    and the ring hands its runs out again."""
    values, manager = caches()
    transfer = KVTransfer(manager, values, kernel="triton")
    generator = np.random.default_rng(3)
    slots = block_aligned(32, generator)
    states = np.array([1], dtype=np.int64)
    out = [torch.zeros(group.slots_shape(slots.size, 1), dtype=group.dtype) for group in manager.kv_layer_groups]
    transfer.pack(slots, state_indices=states, out=out, defer=True)  # queued for a launch that fails
    copier = transfer._copiers[1]
    real = copier.launch  # type: ignore[union-attr]

    def broken(*arguments: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    copier.launch = broken  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        transfer.launch(scatter=False)
    copier.launch = real  # type: ignore[union-attr]
    assert all(c.queue(False).num_runs == 0 for c in transfer._copiers)  # type: ignore[union-attr]
    assert all(lease.completion is not None for c in transfer._copiers for lease in c.ring.leases)  # type: ignore[union-attr]
    # The groups after the one that failed never copied the failed call's chunk, not even at the next launch.
    again = block_aligned(16, generator)
    packed = transfer.pack(again, state_indices=np.array([2], dtype=np.int64), out=[
        torch.zeros(group.slots_shape(16, 1), dtype=group.dtype) for group in manager.kv_layer_groups])
    assert not out[2].view(torch.uint8).any()
    expected = KVTransfer(manager, values, kernel="torch").pack(torch.from_numpy(again), state_indices=[2])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(packed, expected, strict=True))
