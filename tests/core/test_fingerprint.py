"""The fingerprint is the same in every process and pinned to the chunk format it describes."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from kvgroups import KVLayerGroupsManager, LMCacheMetadata, SlidingWindow

SCRIPT = """
import torch
from kvgroups import LMCacheMetadata, KVLayerGroupsManager, SlidingWindow
caches = {f"l{i}": torch.empty(2, 8, 16, 8, 64, dtype=torch.bfloat16, device="meta") for i in range(4)}
manager = KVLayerGroupsManager()
manager.build_kv_layer_groups(caches, {"l1": SlidingWindow(window_tokens=128)})
metadata = LMCacheMetadata("org/model", 2, 2, 1, 1, torch.bfloat16, (4, 2, 256, 8, 64),
                           kv_layer_groups_manager=manager)
print(metadata.fingerprint())
"""


def fingerprint_here() -> str:
    caches = {f"l{i}": torch.empty(2, 8, 16, 8, 64, dtype=torch.bfloat16, device="meta") for i in range(4)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {"l1": SlidingWindow(window_tokens=128)})
    metadata = LMCacheMetadata("org/model", 2, 2, 1, 1, torch.bfloat16, (4, 2, 256, 8, 64),
                               kv_layer_groups_manager=manager)
    return metadata.fingerprint()


def test_fingerprint_is_stable_across_processes_and_hash_seeds() -> None:
    expected = fingerprint_here()
    for seed in ("0", "12345"):
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert result.stdout.strip() == expected


def test_fingerprint_is_pinned() -> None:
    # Changing this value means every stored chunk becomes unreadable: bump CHUNK_FORMAT instead.
    assert fingerprint_here() == "d2de07095d4745c2f26cde25009b74399fc858d0b259484a86a8445bef907919"
