"""Build and lookup time of layer groups: kvgroups vs LMCache 0.4.1 (when importable), one run.

Layers are meta tensors (nothing is allocated). Cases: 32 layers in 1 group, 128 layers in 8
groups, 1000 layers in 64 groups (groups differ in head count, interleaved across layers).
The two implementations run interleaved (ours, LMCache, ours, LMCache, ...) and each ratio is the
median over those pairs. Prints a table; speedups > 1 mean kvgroups is faster.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import torch

import kvgroups
from benchmarks.support.unmeasured import Unmeasured

CASES = ((32, 1), (128, 8), (1000, 64))


def make_caches(num_layers: int, num_groups: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{index}.self_attn.attn": torch.empty(
            2, 512, 16, 1 + index % num_groups, 128, dtype=torch.bfloat16, device="meta"
        )
        for index in range(num_layers)
    }


def seconds(action: Callable[[], Any], number: int) -> float:
    return timeit.timeit(action, number=number) / number


def actions(manager_cls: Any, caches: dict[str, torch.Tensor]) -> dict[str, Callable[[], None]]:
    """build, lookup of every layer by index, and by name (the lookups on a manager built once)."""
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

    return {"build": build, "index": by_index, "name": by_name}


Times = dict[str, dict[str, list[float]]]


def measure(variants: dict[str, Any], caches: dict[str, torch.Tensor], repeat: int) -> Times:
    """Seconds per call of each action of each variant, the variants interleaved (A, B, A, B, ...)."""
    bound = {name: actions(cls, caches) for name, cls in variants.items()}
    times: Times = {name: {"build": [], "index": [], "name": []} for name in variants}
    for _ in range(repeat):
        for action in ("build", "index", "name"):
            for name in variants:
                per_call = seconds(bound[name][action], 20)
                times[name][action].append(per_call / (1 if action == "build" else len(caches)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    unmeasured, missing = Unmeasured(), ""
    try:
        reference: Any = importlib.import_module("lmcache.v1.kv_layer_groups").KVLayerGroupsManager
        # LMCache logs every build at INFO to stderr; silence it so its timing is not our I/O.
        logging.getLogger("lmcache").setLevel(logging.WARNING)
        logging.getLogger("lmcache.v1.kv_layer_groups").setLevel(logging.WARNING)
    except ImportError as error:
        reference = None
        missing = f"LMCache not importable ({error}; pip install --no-deps lmcache==0.4.1)"
    header = (
        "| layers | groups | build µs (ours) | build µs (LMCache) | build ratio | "
        "lookup by index ns (ours / LMCache) | speedup | lookup by name ns (ours / LMCache) | speedup |"
    )
    print(header)
    print("|---" * 9 + "|")
    for num_layers, num_groups in CASES:
        caches = make_caches(num_layers, num_groups)
        variants = {"ours": kvgroups.KVLayerGroupsManager}
        if reference is not None:
            variants["lmcache"] = reference
        times = measure(variants, caches, args.repeat)
        ours = {action: statistics.median(values) for action, values in times["ours"].items()}
        if reference is None:
            print(
                f"| {num_layers} | {num_groups} | {ours['build'] * 1e6:.0f} | - | - | "
                f"{ours['index'] * 1e9:.0f} / - | - | {ours['name'] * 1e9:.0f} / - | - |"
            )
            print(unmeasured.row(f"LMCache, {num_layers} layers", missing, columns=9))
            continue
        theirs = {action: statistics.median(values) for action, values in times["lmcache"].items()}

        def ratio(action: str, times: Times = times) -> float:
            """Median over the interleaved pairs of LMCache's time / ours."""
            pairs = zip(times["ours"][action], times["lmcache"][action], strict=True)
            return statistics.median(theirs / ours for ours, theirs in pairs)

        print(
            f"| {num_layers} | {num_groups} | {ours['build'] * 1e6:.0f} | {theirs['build'] * 1e6:.0f} | "
            f"{1 / ratio('build'):.2f}x slower | "
            f"{ours['index'] * 1e9:.0f} / {theirs['index'] * 1e9:.0f} | {ratio('index'):.1f}x | "
            f"{ours['name'] * 1e9:.0f} / {theirs['name'] * 1e9:.0f} | {ratio('name'):.1f}x |"
        )
    unmeasured.exit()


if __name__ == "__main__":
    main()
