"""Pack/unpack throughput on a Llama-3.1-8B-like layer set, against plain copies of the same bytes.

32 layers of vLLM FlashAttention caches ``[2, num_blocks, 16, 8, 128]`` bf16 (2 GiB in all by
default, so chunks are not cache-hot: each iteration moves a different 256-token chunk), allocated
  * one tensor per layer (as vLLM and SGLang allocate them), or
  * as views of one pool for all layers (as engines with a single KV pool allocate them),
for block-aligned slot mappings over a shuffled block table and for arbitrary distinct slots.
Baselines, measured in the same loop:
  (a)  torch ``copy_`` of a chunk's bytes from a region of a large buffer that is not cache-hot
       into a reused chunk buffer (what pack does at best);
  (a') the reverse, the reused chunk buffer into a region that is not cache-hot (unpack at best).
Every variant runs interleaved with the others (A, B, C, ..., A, B, C, ...), each on its own
region, and each ratio is the median over iterations of (baseline time / variant time) for the
same iteration. Then: 16-token calls (the fixed cost of a call), pack with and without ``out=``
(reused vs freshly allocated chunks), and the numba kernel's first-call cost (compile, then cached).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from kvgroups import KVLayerGroupsManager
from kvgroups.transfer import KVTransfer, pack, unpack

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, CHUNK = 32, 16, 8, 128, 256
HIDDEN = NUM_KV_HEADS * HEAD_SIZE
Action = Callable[[int], object]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(variants: dict[str, Action], iterations: int, device: torch.device, *,
                device_only: bool = False) -> dict[str, list[float]]:
    """Seconds per iteration of each variant, run in turn so that noise hits all alike.

    The order is shuffled each iteration (from a fixed seed): whatever one variant leaves behind
    (torch's threads spinning on after a multi-threaded copy, caches and TLBs filled with its
    memory) falls on a different variant each time, never always on the one that follows it.
    ``device_only`` (CUDA): the stream is kept busy by a sleep kernel while a variant is issued, and
    events time what it ran on the device: the copies alone, without the host work before their launch.
    """
    for action in variants.values():
        action(0)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    order = random.Random(0)
    for iteration in range(1, iterations + 1):
        order.shuffle(names)
        for name in names:
            action = variants[name]
            synchronize(device)
            if device_only and device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(20_000_000)  # longer than any variant's host work
                start.record()
                action(iteration)
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1000)
                continue
            begin = time.perf_counter()
            action(iteration)
            synchronize(device)
            times[name].append(time.perf_counter() - begin)
    return times


def paired(times: dict[str, list[float]], baseline: str, variant: str) -> float:
    """Median over iterations of baseline time / variant time (above 1: the variant is faster)."""
    return statistics.median(b / v for b, v in zip(times[baseline], times[variant], strict=True))


def stride_through(count: int, at_least: int) -> int:
    """How many windows of ``count`` an iteration steps on: at least ``at_least`` (each variant its own window
    in an iteration) and prime to ``count``, so that over the iterations each variant visits every window.

    (A step of 16 over 64 windows, as before, kept each variant on four chunks of slots and four regions
    of its baseline for the whole run.)
    """
    step = at_least
    while math.gcd(step, count) != 1:
        step += 1
    return step


def make_caches(allocation: str, cache_gib: float, device: torch.device) -> dict[str, torch.Tensor]:
    block_bytes = NUM_LAYERS * 2 * BLOCK_SIZE * HIDDEN * 2
    num_blocks = int(cache_gib * (1 << 30)) // block_bytes
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    if allocation == "pool":
        layers = list(torch.full((NUM_LAYERS, *shape), 1.0, dtype=torch.bfloat16, device=device).unbind(0))
    else:
        layers = [torch.full(shape, 1.0, dtype=torch.bfloat16, device=device) for _ in range(NUM_LAYERS)]
    return {f"model.layers.{index}.self_attn.attn": layer for index, layer in enumerate(layers)}


def throughput(allocation: str, cache_gib: float, iterations: int, device: torch.device,
               device_only: bool = False) -> tuple[list[str], list[str]]:
    """The table's rows for one allocation, and how each bound transfer moves scattered rows (its repr)."""
    torch.manual_seed(0)
    caches = make_caches(allocation, cache_gib, device)
    num_blocks = next(iter(caches.values())).shape[1]
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    kernel = KVTransfer(manager, caches).kernel
    bound = {
        kernel: KVTransfer(manager, caches),
        f"{kernel}, 1 thread": KVTransfer(manager, caches, num_threads=1),
        "torch": KVTransfer(manager, caches, kernel="torch"),
    }
    if kernel == "torch":  # no fast kernel here: the torch path is the only one
        del bound["torch, 1 thread"]
    chunk = torch.empty(2, NUM_LAYERS, CHUNK, HIDDEN, dtype=torch.bfloat16, device=device)
    numel = chunk.numel()
    chunk_bytes = numel * chunk.element_size()
    region = torch.full((int(cache_gib * (1 << 30)) // 2,), 1.0, dtype=torch.bfloat16, device=device)
    regions = region.numel() // numel
    block_table = torch.randperm(num_blocks)
    every_slot = torch.randperm(num_blocks * BLOCK_SIZE)
    chunks_per_table = num_blocks * BLOCK_SIZE // CHUNK
    arange = torch.arange(BLOCK_SIZE)

    def slots_of(mode: str, position: int) -> torch.Tensor:
        """On the host, as the connector hands them (slots on the device are read back to be checked)."""
        position %= chunks_per_table
        if mode == "block-aligned":
            blocks = block_table[position * (CHUNK // BLOCK_SIZE):(position + 1) * (CHUNK // BLOCK_SIZE)]
            return (blocks[:, None] * BLOCK_SIZE + arange).flatten()
        return every_slot[position * CHUNK:(position + 1) * CHUNK]

    variants: dict[str, Action] = {}
    count = 0

    def add(name: str, make: Callable[[int], Action]) -> None:
        nonlocal count
        variants[name] = make(count)  # each variant walks its own regions and chunks
        count += 1

    num_variants = 2 + 4 * len(bound)
    chunk_step, region_step = stride_through(chunks_per_table, num_variants), stride_through(regions, num_variants)

    def copy_in(offset: int) -> Action:
        return lambda i: chunk.view(-1).copy_(region[((i * region_step + offset) % regions) * numel:][:numel])

    def copy_out(offset: int) -> Action:
        return lambda i: region[((i * region_step + offset) % regions) * numel:][:numel].copy_(chunk.view(-1))

    add("(a)", copy_in)
    add("(a')", copy_out)
    for name, transfer in bound.items():
        for mode in ("block-aligned", "arbitrary slots"):
            def packer(offset: int, transfer: KVTransfer = transfer, mode: str = mode) -> Action:
                return lambda i: transfer.pack(slots_of(mode, i * chunk_step + offset), out=[chunk])

            def unpacker(offset: int, transfer: KVTransfer = transfer, mode: str = mode) -> Action:
                return lambda i: transfer.unpack([chunk], slots_of(mode, i * chunk_step + offset))

            add(f"{name}|{mode}|pack", packer)
            add(f"{name}|{mode}|unpack", unpacker)
    times = interleaved(variants, iterations, device, device_only=device_only)
    copy_in_seconds, copy_out_seconds = statistics.median(times["(a)"]), statistics.median(times["(a')"])
    rows = [
        f"| {allocation} | (a) copy_ from a cold region | - | torch | {chunk_bytes / copy_in_seconds / 1e9:.2f} "
        f"| 1.00 |",
        f"| {allocation} | (a') copy_ into a cold region | - | torch | {chunk_bytes / copy_out_seconds / 1e9:.2f} "
        f"| 1.00 |",
    ]
    for key in variants:
        if "|" not in key:
            continue
        name, mode, op = key.split("|")
        baseline = "(a)" if op == "pack" else "(a')"
        rows.append(
            f"| {allocation} | {mode} | {op} | {name} | {chunk_bytes / statistics.median(times[key]) / 1e9:.2f} | "
            f"{paired(times, baseline, key):.2f} |"
        )
    return rows, [f"{allocation}, {name}: {transfer!r}" for name, transfer in bound.items() if name != "torch"]


def small_calls(iterations: int, device: torch.device) -> list[str]:
    """16-token calls (one block) on 32 layers: what one call costs beyond its bytes."""
    caches = make_caches("per-layer", 0.25, device)
    num_blocks = next(iter(caches.values())).shape[1]
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    bound = KVTransfer(manager, caches)
    reference = KVTransfer(manager, caches, kernel="torch")
    chunk = torch.empty(2, NUM_LAYERS, BLOCK_SIZE, HIDDEN, dtype=torch.bfloat16, device=device)
    slots = [torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE) for block in range(num_blocks)]  # on the host
    # Each variant's blocks lie num_blocks / 7 blocks (about 36 MiB of the 32 layers) after the previous
    # variant's: a block one variant moved is one another moves only after about 20 iterations, when no
    # CPU cache holds it any more. (Blocks a few apart, as before, made some variants read what another
    # had moved two iterations earlier, still in the L3 cache: one of two identical transfers measured
    # 1.1-1.3x the other's time.)
    spacing = num_blocks // 7
    twin = KVTransfer(manager, caches)  # the control: a second transfer bound alike measures 1.00x

    def block(i: int, variant: int) -> torch.Tensor:
        return slots[(i + variant * spacing) % num_blocks]

    variants: dict[str, Action] = {
        f"bound KVTransfer ({bound.kernel})|pack": lambda i: bound.pack(block(i, 0), out=[chunk]),
        f"bound KVTransfer ({bound.kernel})|unpack": lambda i: bound.unpack([chunk], block(i, 1)),
        "bound KVTransfer (torch)|pack": lambda i: reference.pack(block(i, 2), out=[chunk]),
        "bound KVTransfer (torch)|unpack": lambda i: reference.unpack([chunk], block(i, 3)),
        "module function pack()|pack": lambda i: pack(manager, caches, block(i, 4), out=[chunk]),
        "module function unpack()|unpack": lambda i: unpack(manager, caches, [chunk], block(i, 5)),
        f"a second bound KVTransfer ({twin.kernel}), the control|pack": lambda i: twin.pack(block(i, 6), out=[chunk]),
    }
    times = interleaved(variants, iterations, device)
    rows = []
    for key, values in times.items():
        how, op = key.split("|")
        baseline = f"bound KVTransfer ({bound.kernel})|{op}"
        # Paired: each call against the bound call of the same iteration (issue 30's goal: <= 1.2x).
        ratio = "1.00x" if key == baseline else f"{1 / paired(times, baseline, key):.2f}x"
        rows.append(f"| {op} | 16 | {how} | {statistics.median(values) * 1e3:.3f} | {ratio} |")
    return rows


def allocation_cost(iterations: int, device: torch.device) -> list[str]:
    """256-token pack into out=, into the bound object's reused chunks, and into fresh tensors."""
    caches = make_caches("per-layer", 1.0, device)
    num_blocks = next(iter(caches.values())).shape[1]
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    bound = KVTransfer(manager, caches)
    chunk = torch.empty(2, NUM_LAYERS, CHUNK, HIDDEN, dtype=torch.bfloat16, device=device)
    per_chunk = CHUNK // BLOCK_SIZE
    table = torch.randperm(num_blocks)

    def slots(i: int) -> torch.Tensor:
        blocks = table[(i % (num_blocks // per_chunk)) * per_chunk:][:per_chunk]
        return (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()  # on the host

    def fresh(i: int) -> None:
        # What a caller gets without reuse: a new chunk tensor per call (page-faulted on first write).
        out = [torch.empty(2, NUM_LAYERS, CHUNK, HIDDEN, dtype=torch.bfloat16, device=device)]
        bound.pack(slots(i + 2), out=out)

    variants: dict[str, Action] = {
        "pack(out=[reused buffer])": lambda i: bound.pack(slots(i), out=[chunk]),
        "pack() (chunk dropped before the next call)": lambda i: bound.pack(slots(i + 1)),
        "pack(out=[fresh torch.empty])": fresh,
    }
    times = interleaved(variants, iterations, device)
    return [f"| {name} | {statistics.median(values) * 1e3:.2f} |" for name, values in times.items()]


FIRST_CALL = """
import time
begin = time.perf_counter()
import torch
from kvgroups import KVLayerGroupsManager
from kvgroups.transfer import KVTransfer
caches = {f"l{i}": torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16) for i in range(32)}
manager = KVLayerGroupsManager()
manager.build_kv_layer_groups(caches)
ready = time.perf_counter()
transfer = KVTransfer(manager, caches)
chunks = transfer.pack(torch.arange(256))
transfer.unpack(chunks, torch.arange(256, 512))
print(transfer.kernel, time.perf_counter() - ready)
"""


def first_call_cost() -> list[str]:
    """Bind + first pack/unpack in a new process: numba compiling (empty cache), then loading its cache."""
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        environment = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        for label in ("first run (compiles)", "later runs (cache=True)"):
            output = subprocess.run([sys.executable, "-c", FIRST_CALL], env=environment, capture_output=True,
                                    text=True, check=True).stdout.split()
            rows.append(f"| {label} | {output[0]} | {float(output[1]):.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-gib", type=float, default=2.0, help="total size of the caches (>= 1)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--small-iterations", type=int, default=400)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--allocation", choices=["per-layer", "pool", "both"], default="both")
    args = parser.parse_args()
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    print(f"{NUM_LAYERS} layers x [2, num_blocks, {BLOCK_SIZE}, {NUM_KV_HEADS}, {HEAD_SIZE}] bf16, "
          f"{args.cache_gib} GiB of caches on {device}; chunk [2, {NUM_LAYERS}, {CHUNK}, {HIDDEN}] = "
          f"{2 * NUM_LAYERS * CHUNK * HIDDEN * 2 >> 20} MiB; torch threads {threads}; "
          f"{args.iterations} interleaved iterations\n")
    print("| allocation | slot mapping (or baseline) | op | kernel | GB/s | vs (a) for pack, (a') for unpack |")
    print("|---|---|---|---|---|---|")
    allocations = ["per-layer", "pool"] if args.allocation == "both" else [args.allocation]
    chosen = []
    for allocation in allocations:
        rows, transfers = throughput(allocation, args.cache_gib, args.iterations, device)
        for row in rows:
            print(row, flush=True)
        chosen += transfers
    if device.type == "cuda":  # the copies alone: the stream busy while each call is issued
        print("\nThe same, timed on the device alone (the stream kept busy while each call is issued):\n")
        print("| allocation | slot mapping (or baseline) | op | kernel | GB/s | vs (a) for pack, (a') for unpack |")
        print("|---|---|---|---|---|---|")
        for allocation in allocations:
            for row in throughput(allocation, args.cache_gib, args.iterations, device, device_only=True)[0]:
                print(row, flush=True)
    print("\nThe transfers measured (what each chose when it bound):\n")
    for line in chosen:
        print(f"- {line}")
    print(f"\nSmall calls: 32 layers, one tensor per layer, medians of {args.small_iterations} interleaved calls\n")
    print("| op | tokens | how | ms per call | vs the bound call (paired) |")
    print("|---|---|---|---|---|")
    for row in small_calls(args.small_iterations, device):
        print(row, flush=True)
    print(f"\nChunk memory: 256-token block-aligned pack, medians of {args.iterations * 2} interleaved calls\n")
    print("| call | ms per call |")
    print("|---|---|")
    for row in allocation_cost(args.iterations * 2, device):
        print(row, flush=True)
    if device.type == "cpu":
        print("\nFirst call in a new process (bind, pack, unpack of 256 tokens on 32 layers)\n")
        print("| run | kernel | seconds |")
        print("|---|---|---|")
        for row in first_call_cost():
            print(row, flush=True)


if __name__ == "__main__":
    main()
