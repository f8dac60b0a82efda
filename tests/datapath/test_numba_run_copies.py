"""The numba kernel's run copiers byte for byte: runs in lockstep of every length, asking ahead or not.

The copiers that ask for the bytes a few KiB on in a run (gathers of long runs) stop asking before the
run's end and copy the rest plainly; every length around those edges must move exactly its bytes and
touch nothing else, with stores into the cache and with stores that bypass it. The streaming path of
pack (chunks of 4 MiB and more) is forced on small chunks so that Hypothesis can walk its layouts.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba missing")

if importlib.util.find_spec("numba") is not None:
    from numba import njit

    from kvgroups.datapath import numba_copy
    from kvgroups.datapath.numba_intrinsics import (
        AHEAD_RUN_BYTES,
        STREAMING_STORES,
        WIDE_ROWS,
        copy_pieces,
        copy_wide,
    )

    @njit(cache=False)
    def _four(targets: Any, sources: Any, num_bytes: int, streaming: bool) -> None:
        copy_pieces((targets[0], targets[1], targets[2], targets[3]), (sources[0], sources[1], sources[2], sources[3]),
                    num_bytes, streaming)

    @njit(cache=False)
    def _sixteen(targets: Any, sources: Any, num_bytes: int, streaming: bool) -> None:
        copy_wide((targets[0], targets[1], targets[2], targets[3], targets[4], targets[5], targets[6], targets[7],
                   targets[8], targets[9], targets[10], targets[11], targets[12], targets[13], targets[14],
                   targets[15]),
                  (sources[0], sources[1], sources[2], sources[3], sources[4], sources[5], sources[6], sources[7],
                   sources[8], sources[9], sources[10], sources[11], sources[12], sources[13], sources[14],
                   sources[15]), num_bytes, streaming)

GUARD = 256  # bytes around every run that must stay as they were


def _copy_runs(rows: int, num_bytes: int, streaming: bool, seed: int) -> None:
    """Copy ``rows`` runs of ``num_bytes`` between two buffers and check every byte of both."""
    alignment = 64 if rows == WIDE_ROWS else 32
    span = num_bytes + 2 * GUARD + alignment
    generator = np.random.default_rng(seed)
    source = generator.integers(0, 256, rows * span + 64, dtype=np.uint8)
    target = generator.integers(0, 256, rows * span + 64, dtype=np.uint8)
    before = target.copy()
    # Streaming stores need aligned destinations; sources may sit anywhere.
    target_start = GUARD + (-target.ctypes.data - GUARD) % alignment
    source_starts = [row * span + GUARD + int(generator.integers(0, alignment)) for row in range(rows)]
    target_starts = [row * span + target_start for row in range(rows)]
    targets = np.array([target.ctypes.data + at for at in target_starts], dtype=np.int64)
    sources = np.array([source.ctypes.data + at for at in source_starts], dtype=np.int64)
    (_sixteen if rows == WIDE_ROWS else _four)(targets, sources, num_bytes, streaming)
    wanted = before.copy()
    for source_at, target_at in zip(source_starts, target_starts, strict=True):
        wanted[target_at:target_at + num_bytes] = source[source_at:source_at + num_bytes]
    assert np.array_equal(target, wanted), (rows, num_bytes, streaming)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3 * AHEAD_RUN_BYTES + 100), st.integers(0, 2**32 - 1))
def test_four_runs_in_lockstep_move_exactly_their_bytes(num_bytes: int, seed: int) -> None:
    _copy_runs(4, num_bytes, streaming=False, seed=seed)
    if STREAMING_STORES:
        _copy_runs(4, num_bytes // 32 * 32, streaming=True, seed=seed)


@pytest.mark.parametrize("num_bytes", [0, 32, AHEAD_RUN_BYTES - 32, AHEAD_RUN_BYTES, AHEAD_RUN_BYTES + 32,
                                       2 * AHEAD_RUN_BYTES, 32 * 1024])
@pytest.mark.parametrize("streaming", [False, True])
def test_runs_at_the_edges_of_asking_ahead_move_exactly_their_bytes(num_bytes: int, streaming: bool) -> None:
    if streaming and not STREAMING_STORES:
        pytest.skip("no streaming stores on this machine")
    _copy_runs(4, num_bytes, streaming, seed=num_bytes)
    _copy_runs(WIDE_ROWS, num_bytes // 64 * 64, streaming, seed=num_bytes + 1)


def test_a_streaming_pack_moves_the_same_bytes_as_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 4 MiB and more are packed with stores that bypass the cache and runs asked for ahead:
    forced here on small chunks, block-aligned, arbitrary and runs of every length, on one thread and two."""
    from kvgroups import KVLayerGroupsManager
    from kvgroups.transfer import KVTransfer

    monkeypatch.setattr(numba_copy, "STREAMING_MIN_BYTES", 0)
    generator = torch.Generator().manual_seed(7)
    # Rows of 512 bytes: a 16-token block is an 8 KiB run, longer than AHEAD_RUN_BYTES.
    caches = {f"l{i}": torch.randint(-1000, 1000, (2, 64, 16, 2, 128), generator=generator).to(torch.bfloat16)
              for i in range(3)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    reference = KVTransfer(manager, caches, kernel="torch")
    for threads in (1, 2):
        monkeypatch.setattr(numba_copy, "PARALLEL_MIN_BYTES", 0 if threads == 2 else 1 << 62)
        fast = KVTransfer(manager, caches, kernel="numba", num_threads=threads)
        blocks = torch.randperm(64, generator=generator)[:12]
        mappings = [
            (blocks[:, None] * 16 + torch.arange(16)).flatten(),  # block-aligned
            torch.randperm(64 * 16, generator=generator)[:200],  # arbitrary
            torch.cat([torch.arange(b * 16, b * 16 + n) for b, n in zip(blocks.tolist(), range(1, 13), strict=True)]),
        ]
        for slots in mappings:
            out = torch.empty(2, 3, slots.numel(), 256, dtype=torch.bfloat16)
            fast.pack(slots, out=[out])
            (expected,) = reference.pack(slots)
            assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), (threads, slots[:4].tolist())
