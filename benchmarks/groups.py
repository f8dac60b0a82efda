"""Build and lookup time of layer groups: kvgroups vs LMCache 0.4.1 (when importable), one run.

Layers are meta tensors (nothing is allocated). Cases: 32 layers in 1 group, 128 layers in 8
groups, 1000 layers in 64 groups (groups differ in head count, interleaved across layers).
Prints a table; ratios > 1 mean kvgroups is faster.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import timeit
from collections.abc import Callable
from typing import Any

import torch

import kvgroups

CASES = ((32, 1), (128, 8), (1000, 64))


def make_caches(num_layers: int, num_groups: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{index}.self_attn.attn": torch.empty(
            2, 512, 16, 1 + index % num_groups, 128, dtype=torch.bfloat16, device="meta"
        )
        for index in range(num_layers)
    }


def best_seconds(action: Callable[[], Any], repeat: int, number: int) -> float:
    return min(timeit.repeat(action, repeat=repeat, number=number)) / number


def measure(manager_cls: Any, caches: dict[str, torch.Tensor], repeat: int) -> dict[str, float]:
    def build() -> None:
        manager_cls().build_kv_layer_groups(caches)

    manager = manager_cls()
    manager.build_kv_layer_groups(caches)
    names = list(caches)
    indices = list(range(len(names)))

    def by_index() -> None:
        lookup = manager.get_group_by_layer_idx
        for index in indices:
            lookup(index)

    def by_name() -> None:
        lookup = manager.get_group_by_layer_name
        for name in names:
            lookup(name)

    count = len(names)
    return {
        "build_us": best_seconds(build, repeat, 20) * 1e6,
        "index_ns": best_seconds(by_index, repeat, 20) / count * 1e9,
        "name_ns": best_seconds(by_name, repeat, 20) / count * 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    try:
        reference: Any = importlib.import_module("lmcache.v1.kv_layer_groups").KVLayerGroupsManager
        # LMCache logs every build at INFO to stderr; silence it so its timing is not our I/O.
        logging.getLogger("lmcache").setLevel(logging.WARNING)
        logging.getLogger("lmcache.v1.kv_layer_groups").setLevel(logging.WARNING)
    except ImportError:
        reference = None
        print("LMCache not importable: showing kvgroups only (pip install --no-deps lmcache==0.4.1)")
    header = (
        "| layers | groups | build µs (ours) | build µs (LMCache) | build ratio | "
        "lookup by index ns (ours / LMCache) | speedup | lookup by name ns (ours / LMCache) | speedup |"
    )
    print(header)
    print("|---" * 9 + "|")
    for num_layers, num_groups in CASES:
        caches = make_caches(num_layers, num_groups)
        ours = measure(kvgroups.KVLayerGroupsManager, caches, args.repeat)
        if reference is None:
            print(
                f"| {num_layers} | {num_groups} | {ours['build_us']:.0f} | - | - | "
                f"{ours['index_ns']:.0f} / - | - | {ours['name_ns']:.0f} / - | - |"
            )
            continue
        theirs = measure(reference, caches, args.repeat)
        print(
            f"| {num_layers} | {num_groups} | {ours['build_us']:.0f} | {theirs['build_us']:.0f} | "
            f"{ours['build_us'] / theirs['build_us']:.2f}x slower | "
            f"{ours['index_ns']:.0f} / {theirs['index_ns']:.0f} | "
            f"{theirs['index_ns'] / ours['index_ns']:.1f}x | "
            f"{ours['name_ns']:.0f} / {theirs['name_ns']:.0f} | "
            f"{theirs['name_ns'] / ours['name_ns']:.1f}x |"
        )


if __name__ == "__main__":
    main()
