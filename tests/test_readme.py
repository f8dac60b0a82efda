"""The README's code runs and says what it prints."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvgroups import LayerKind

README = (Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def block_with(text: str) -> str:
    (found,) = [block for block in BLOCKS if text in block]
    return found


def test_library_usage_block_runs_and_its_comments_hold() -> None:
    block = block_with("metadata.kv_layer_groups_manager.build_kv_layer_groups(caches, specs)")
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)
    manager, metadata, other = namespace["manager"], namespace["metadata"], namespace["other"]
    assert manager.num_groups == 2  # type: ignore[attr-defined]
    assert manager.get_group_by_layer_idx(3).kind is LayerKind.FULL_ATTENTION  # type: ignore[attr-defined]
    assert metadata.get_shapes() == [torch.Size([2, 12, 256, 512])] * 2  # type: ignore[attr-defined]
    assert other.kv_layer_groups[0].hidden_dim_size == 512  # type: ignore[attr-defined]


def test_data_path_block_runs() -> None:
    block = block_with("transfer = KVTransfer(groups, kv_caches)")
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), namespace)
    chunk, kv_caches, transfer = namespace["chunk"], namespace["kv_caches"], namespace["transfer"]
    assert chunk.shape == (2, 4, 256, 1024) and chunk.dtype == torch.bfloat16  # type: ignore[attr-defined]
    assert transfer.kernels in (["numba"], ["torch"])  # type: ignore[attr-defined]
    moved = kv_caches["layers.3"][:, 32:48].reshape(2, 256, 1024)  # type: ignore[index]
    assert torch.equal(moved, chunk[:, 3])  # type: ignore[index]
