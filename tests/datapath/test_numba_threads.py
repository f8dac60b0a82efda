"""The CPU kernel and torch share OpenMP: a parallel copy must leave torch's thread count alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba missing")


def test_the_numba_kernel_leaves_torchs_thread_count_as_the_caller_set_it() -> None:
    """numba's OpenMP layer shares libgomp with torch: a parallel launch must not undo torch.set_num_threads(1).

    In a fresh process, since which threading layer numba picks is decided once per process.
    """
    script = """
import torch
from kvgroups.datapath import kernels, numba_copy
from kvgroups import KVLayerGroupsManager
from kvgroups.transfer import KVTransfer
torch.set_num_threads(1)
numba_copy.PARALLEL_MIN_BYTES = 0
caches = {f"layers.{i}": torch.randn(2, 8, 16, 4, 32) for i in range(2)}
manager = KVLayerGroupsManager()
manager.build_kv_layer_groups(caches)
transfer = KVTransfer(manager, caches, kernel="numba", num_threads=2)
transfer.pack(torch.arange(64))  # the process's first parallel launch starts numba's threads
after_copy = torch.get_num_threads()
kernels.warm_up()
print(after_copy, torch.get_num_threads(), numba_copy.numba.threading_layer())
"""
    environment = {name: value for name, value in os.environ.items() if name != "KVGROUPS_KERNEL"}
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                               env=environment)
    after_copy, after_warm_up, layer = completed.stdout.split()
    assert (after_copy, after_warm_up) == ("1", "1"), f"threading layer {layer}"
