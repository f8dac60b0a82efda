"""Host microseconds of a pack and an unpack call with the Triton kernels, the launch replaced by a stub.

What a call costs the launching thread, on any machine: the caches are a Llama-3.1-8B-like set (32 layers of
vLLM FlashAttention pages ``[2, blocks, 16, 8, 128]`` bf16) on the CPU, bound with ``kernel="triton"``, and every
launch is a stub that returns at once, so what is timed is the call's own host work: checks, planning, the
descriptor runs, the launch's arguments. Rows:
  * one call: a 256-token block-aligned chunk and 256 scattered slots, pack into and unpack from a chunk the
    kernel addresses (``out=``, ``synchronize=False``, NumPy slots as the connector hands them);
  * a bare NumPy pass over the same slots (their bounds reduction and a copy into a reused array): the least a
    call that checks and hands over its slots can do, paired with each call;
  * a worker's step: R requests x C chunks in each of G groups (one transfer per group, as the vLLM connector
    binds them), every chunk queued (``defer=True``), then one launch per group; per step and per chunk.
``--baseline REF`` times the same one-call rows on the code of git ``REF`` (the last commit before the run
queues: each call planned with torch operations, one launch per table, ``_copy_rows`` and ``_copy_states``
stubbed there) in a subprocess, alternating with this tree's, process by process (A, B, A, B, ...), and
reports the median of the paired ratios. On the CPU the baseline's torch operations run where on a GPU they
would be launched; each costs about what its launch would (microseconds), so the figure is an estimate of
that path's host work, not a measurement on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton binds CPU tensors only under its interpreter

import numpy as np
import torch

from kvgroups import KVLayerGroupsManager, KVLayout
from kvgroups.transfer import KVTransfer

LAYERS, BLOCK, HEADS, HEAD, CHUNK, BLOCKS = 32, 16, 8, 128, 256, 128
ROOT = Path(__file__).resolve().parents[2]


def caches(layers: int = LAYERS, prefix: str = "layers") -> tuple[dict[str, torch.Tensor], KVLayerGroupsManager]:
    values = {f"{prefix}.{index}": torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.bfloat16)
              for index in range(layers)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, layout=dict.fromkeys(values, KVLayout.FLASH_ATTN))
    return values, manager


def stub(transfer: KVTransfer) -> None:
    """Every launch of ``transfer`` returns at once (this tree's run copiers)."""
    for copier in transfer._copiers:
        copier.launch = lambda kernel, grid, arguments, constants: None  # type: ignore[union-attr]


def stub_baseline() -> None:
    """The baseline tree's kernels, launched as ``kernel[grid](...)``, return at once."""
    from kvgroups.datapath import triton_copy

    class Stub:
        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return lambda *arguments, **constants: None

    for name in ("_copy_rows", "_copy_states"):
        if hasattr(triton_copy, name):
            setattr(triton_copy, name, Stub())


def slot_sets() -> dict[str, np.ndarray]:
    generator = np.random.default_rng(0)
    blocks = generator.permutation(np.arange(1, BLOCKS))[:CHUNK // BLOCK]
    aligned = (blocks[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1).astype(np.int64)
    scattered = generator.permutation(BLOCKS * BLOCK)[:CHUNK].astype(np.int64)
    return {"block-aligned": aligned, "scattered": scattered}


def timed(action: Callable[[], object], repeats: int) -> float:
    """Median microseconds of ``action`` over ``repeats`` runs of 20 calls each."""
    for _ in range(50):
        action()
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        for _ in range(20):
            action()
        samples.append((time.perf_counter() - begin) / 20 * 1e6)
    return statistics.median(samples)


def one_call_rows(repeats: int, baseline: bool) -> dict[str, float]:
    """Microseconds per call: pack and unpack of each slot set, and the bare NumPy pass over it."""
    values, manager = caches()
    transfer = KVTransfer(manager, values, kernel="triton")
    if baseline:
        stub_baseline()
    else:
        stub(transfer)
    group = manager.kv_layer_groups[0]
    out = [torch.empty(group.slots_shape(CHUNK), dtype=group.dtype)]
    rows: dict[str, float] = {}
    reused = np.empty(CHUNK, dtype=np.int64)
    for name, slots in slot_sets().items():
        # The baseline takes tensors; this tree reads NumPy slots where they are (a tensor's .numpy() is an alias).
        given: Any = torch.from_numpy(slots) if baseline else slots
        rows[f"pack {name}"] = timed(lambda given=given: transfer.pack(given, out=out, synchronize=False), repeats)
        rows[f"unpack {name}"] = timed(lambda given=given: transfer.unpack(out, given, synchronize=False), repeats)

        def bare(slots: np.ndarray = slots) -> None:
            int(slots.view(np.uint64).max())
            reused[:] = slots

        rows[f"bare NumPy {name}"] = timed(bare, repeats)
    return rows


def step_rows(requests: int, chunks: int, groups: int, repeats: int) -> dict[str, float]:
    """Microseconds per step of ``requests`` x ``chunks`` block-aligned chunks in each of ``groups`` groups."""
    per_group = max(1, LAYERS // groups)
    transfers = []
    for index in range(groups):
        values, manager = caches(per_group, f"group{index}")
        transfer = KVTransfer(manager, values, kernel="triton")
        stub(transfer)
        transfers.append((transfer, manager.kv_layer_groups[0]))
    generator = np.random.default_rng(1)
    slots = [np.ascontiguousarray((generator.permutation(np.arange(1, BLOCKS))[:CHUNK // BLOCK, None] * BLOCK
                                   + np.arange(BLOCK)).reshape(-1), dtype=np.int64)
             for _ in range(requests * chunks)]
    outs = [[torch.empty(group.slots_shape(CHUNK), dtype=group.dtype)] for _, group in transfers]

    def step() -> None:
        # Every chunk into its group's one buffer: the launch is a stub, and where a chunk lands costs nothing here.
        for (transfer, _), out in zip(transfers, outs, strict=True):
            for each in slots:
                transfer.pack(each, out=out, defer=True)
        for transfer, _ in transfers:
            transfer.launch(scatter=False).release(synchronize=False)

    per_step = timed(step, repeats)
    return {f"step {requests}x{chunks}x{groups}": per_step,
            f"step {requests}x{chunks}x{groups} per chunk": per_step / (requests * chunks * groups)}


def run_baseline(reference: str, repeats: int) -> dict[str, float]:
    """The one-call rows on the code of ``reference``, in a subprocess over a checkout of it."""
    with tempfile.TemporaryDirectory() as directory:
        tree = Path(directory) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), reference], check=True)
        try:
            environment = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{ROOT}", "TRITON_INTERPRET": "1"}
            script = (f"import json, benchmarks.datapath.host_cost as b; "
                      f"print(json.dumps(b.one_call_rows({repeats}, baseline=True)))")
            output = subprocess.run([sys.executable, "-c", script], env=environment, cwd=directory, check=True,
                                    capture_output=True, text=True).stdout
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    return dict(json.loads(output.strip().splitlines()[-1]))


def run_current(repeats: int) -> dict[str, float]:
    script = f"import json, benchmarks.datapath.host_cost as b; print(json.dumps(b.one_call_rows({repeats}, False)))"
    environment = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", "TRITON_INTERPRET": "1"}
    output = subprocess.run([sys.executable, "-c", script], env=environment, cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    return dict(json.loads(output.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30, help="samples of 20 calls per row")
    parser.add_argument("--rounds", type=int, default=5, help="baseline/current process pairs (with --baseline)")
    parser.add_argument("--baseline", metavar="REF", help="also time the one-call rows on git REF, interleaved")
    parser.add_argument("--steps", default="1x1x1,4x4x2,8x4x4", help="RxCxG steps to time (requests, chunks, groups)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    if arguments.baseline:
        ratios: dict[str, list[float]] = {}
        currents: dict[str, list[float]] = {}
        baselines: dict[str, list[float]] = {}
        for _ in range(arguments.rounds):
            old = run_baseline(arguments.baseline, arguments.repeats)
            new = run_current(arguments.repeats)
            for name, value in new.items():
                currents.setdefault(name, []).append(value)
                if name in old:
                    baselines.setdefault(name, []).append(old[name])
                    ratios.setdefault(name, []).append(old[name] / value)
        print(f"| call (256 tokens, {LAYERS} layers) | {arguments.baseline} µs | this tree µs | paired ratio |")
        print("|---|---:|---:|---:|")
        for name, values in currents.items():
            if name in ratios:
                print(f"| {name} | {statistics.median(baselines[name]):.1f} | {statistics.median(values):.1f}"
                      f" | {statistics.median(ratios[name]):.2f}x |")
        print()
    rows = one_call_rows(arguments.repeats, baseline=False)
    print("| row (this tree, launch stubbed) | µs | against the bare NumPy pass |")
    print("|---|---:|---:|")
    for name, value in rows.items():
        bare = rows[f"bare NumPy {name.split(' ', 1)[1]}"] if not name.startswith("bare") else value
        print(f"| {name} | {value:.1f} | {value / bare:.1f}x |")
    for spec in arguments.steps.split(","):
        requests, chunks, groups = (int(part) for part in spec.split("x"))
        for name, value in step_rows(requests, chunks, groups, max(5, arguments.repeats // 3)).items():
            print(f"| {name} | {value:.1f} | |")


if __name__ == "__main__":
    main()
