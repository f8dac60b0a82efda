"""Pack/unpack throughput on a Llama-3.1-8B-like layer set, against memory bandwidth and the naive way.

32 layers of vLLM FlashAttention caches ``[2, num_blocks, 16, 8, 128]`` bf16 (2 GiB in all by
default, so chunks are not cache-hot: each iteration moves a different 256-token chunk), allocated
  * one tensor per layer (as vLLM and SGLang allocate them), or
  * as views of one pool for all layers (as engines with a single KV pool allocate them),
for
  * block-aligned slot mappings over a shuffled block table, and
  * arbitrary distinct slots (a random permutation of every slot, 256 at a time).
Baselines, measured in the same run:
  (a) one contiguous copy of the same number of bytes from a source that is not cache-hot
      (the memory-bandwidth limit);
  (b) the straightforward way: per layer, ``index_select`` of the token rows (``index_copy_``
      for unpack);
  (c) for reference, 64 contiguous ``copy_`` calls of the same bytes, one per layer and K/V plane
      (what any per-plane torch approach pays before it gathers anything).
GB/s counts the chunk's bytes once. Ratios above 1 against (b) mean kvgroups is faster.
Set THP_MEM_ALLOC_ENABLE=1 to let torch back the caches with transparent huge pages (random
blocks then cost no TLB misses), as a production KV pool would be.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from kvgroups import KVLayerGroupsManager
from kvgroups.transfer import KVTransfer, pack, unpack

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, CHUNK = 32, 16, 8, 128, 256
HIDDEN = NUM_KV_HEADS * HEAD_SIZE


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(action: Callable[[int], None], iterations: int, device: torch.device) -> float:
    action(0)  # warm-up: allocator, kernels
    times = []
    for iteration in range(1, iterations + 1):
        synchronize(device)
        begin = time.perf_counter()
        action(iteration)
        synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_seconds(chunk: torch.Tensor, cache_gib: float, chunks_in_pool: int, iterations: int,
                 device: torch.device) -> tuple[float, float]:
    """Baselines (a) one contiguous copy of a chunk's bytes from a source that is not cache-hot,
    and (c) the same bytes as one copy per (K/V plane, layer)."""
    source = torch.empty(int(cache_gib * (1 << 30)) // 2, dtype=torch.bfloat16, device=device).fill_(1)

    def contiguous_copy(iteration: int) -> None:
        offset = iteration % chunks_in_pool * chunk.numel()
        chunk.view(-1).copy_(source[offset:offset + chunk.numel()])

    planes = chunk.view(-1, chunk.shape[2] * chunk.shape[3]).unbind(0)

    def plane_copies(iteration: int) -> None:
        offset = iteration % chunks_in_pool * chunk.numel()
        pieces = source[offset:offset + chunk.numel()].view(len(planes), -1)
        for plane, piece in zip(planes, pieces, strict=True):
            plane.copy_(piece)

    return median_seconds(contiguous_copy, iterations, device), median_seconds(plane_copies, iterations, device)


def run(allocation: str, cache_gib: float, iterations: int, device: torch.device) -> list[str]:
    torch.manual_seed(0)
    block_bytes = NUM_LAYERS * 2 * BLOCK_SIZE * HIDDEN * 2
    num_blocks = int(cache_gib * (1 << 30)) // block_bytes
    layer_shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    if allocation == "pool":
        pool = torch.randn(NUM_LAYERS, *layer_shape, device=device).to(torch.bfloat16)
        layers = list(pool.unbind(0))
    else:
        layers = [torch.randn(*layer_shape, device=device).to(torch.bfloat16) for _ in range(NUM_LAYERS)]
    caches = {f"model.layers.{index}.self_attn.attn": layer for index, layer in enumerate(layers)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    chunk = torch.empty(2, NUM_LAYERS, CHUNK, HIDDEN, dtype=torch.bfloat16, device=device)
    chunk_bytes = chunk.numel() * chunk.element_size()
    chunks_in_pool = num_blocks * BLOCK_SIZE // CHUNK
    block_table = torch.randperm(num_blocks)
    arange = torch.arange(BLOCK_SIZE)
    every_slot = torch.randperm(num_blocks * BLOCK_SIZE)

    def aligned_slots(iteration: int) -> torch.Tensor:
        position = iteration % chunks_in_pool * (CHUNK // BLOCK_SIZE)
        blocks = block_table[position:position + CHUNK // BLOCK_SIZE]
        return (blocks[:, None] * BLOCK_SIZE + arange).flatten().to(device)

    def arbitrary_slots(iteration: int) -> torch.Tensor:
        position = iteration % chunks_in_pool * CHUNK
        return every_slot[position:position + CHUNK].to(device)

    bandwidth, per_plane = copy_seconds(chunk, cache_gib, chunks_in_pool, iterations, device)
    rows = [
        f"| {allocation} | (a) one contiguous copy | - | {chunk_bytes / bandwidth / 1e9:.2f} | - | 1.00 | - |",
        f"| {allocation} | (c) 64 contiguous copies | - | {chunk_bytes / per_plane / 1e9:.2f} | - | "
        f"{bandwidth / per_plane:.2f} | - |",
    ]
    for label, slots_of in (("block-aligned", aligned_slots), ("arbitrary slots", arbitrary_slots)):
        def ours_pack(iteration: int, slots_of: Callable[[int], torch.Tensor] = slots_of) -> None:
            pack(manager, caches, slots_of(iteration), out=[chunk])

        def naive_pack(iteration: int, slots_of: Callable[[int], torch.Tensor] = slots_of) -> None:
            slots = slots_of(iteration)
            for layer, cache in enumerate(layers):
                chunk[:, layer] = cache.view(2, -1, HIDDEN).index_select(1, slots)

        def ours_unpack(iteration: int, slots_of: Callable[[int], torch.Tensor] = slots_of) -> None:
            unpack(manager, caches, [chunk], slots_of(iteration))

        def naive_unpack(iteration: int, slots_of: Callable[[int], torch.Tensor] = slots_of) -> None:
            slots = slots_of(iteration)
            for layer, cache in enumerate(layers):
                cache.view(2, -1, HIDDEN).index_copy_(1, slots, chunk[:, layer])

        for op, ours, naive in (("pack", ours_pack, naive_pack), ("unpack", ours_unpack, naive_unpack)):
            ours_seconds = median_seconds(ours, iterations, device)
            naive_seconds = median_seconds(naive, iterations, device)
            rows.append(
                f"| {allocation} | {label} | {op} | {chunk_bytes / ours_seconds / 1e9:.2f} | "
                f"{chunk_bytes / naive_seconds / 1e9:.2f} | {bandwidth / ours_seconds:.2f} | "
                f"{naive_seconds / ours_seconds:.2f}x |"
            )
    return rows


def interleaved(variants: dict[str, Callable[[int], None]], iterations: int,
                device: torch.device) -> dict[str, list[float]]:
    """Seconds per iteration of each variant, run in turn (A, B, A, B, ...) so that noise hits all alike."""
    for action in variants.values():
        action(0)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    for iteration in range(1, iterations + 1):
        for name, action in variants.items():
            synchronize(device)
            begin = time.perf_counter()
            action(iteration)
            synchronize(device)
            times[name].append(time.perf_counter() - begin)
    return times


def small_calls(iterations: int, device: torch.device) -> list[str]:
    """16-token calls (one block) on 32 layers: the per-call cost of the bound object vs the module function."""
    num_blocks = 256
    caches = {
        f"model.layers.{index}.self_attn.attn": torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                                                            dtype=torch.bfloat16, device=device)
        for index in range(NUM_LAYERS)
    }
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    bound = KVTransfer(manager, caches)
    chunk = torch.empty(2, NUM_LAYERS, BLOCK_SIZE, HIDDEN, dtype=torch.bfloat16, device=device)
    slots = [torch.arange(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE, device=device) for block in range(num_blocks)]
    rows = []
    for op in ("pack", "unpack"):
        if op == "pack":
            variants: dict[str, Callable[[int], None]] = {
                "module": lambda i: pack(manager, caches, slots[i % num_blocks], out=[chunk]) and None,
                "bound": lambda i: bound.pack(slots[i % num_blocks], out=[chunk]) and None,
            }
        else:
            variants = {
                "module": lambda i: unpack(manager, caches, [chunk], slots[i % num_blocks]),
                "bound": lambda i: bound.unpack([chunk], slots[i % num_blocks]),
            }
        times = interleaved(variants, iterations, device)
        ratio = statistics.median(m / b for m, b in zip(times["module"], times["bound"], strict=True))
        rows.append(
            f"| {op} | 16 | {statistics.median(times['module']) * 1e3:.3f} | "
            f"{statistics.median(times['bound']) * 1e3:.3f} | {ratio:.2f}x |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-gib", type=float, default=2.0, help="total size of the caches (>= 1)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--allocation", choices=["per-layer", "pool", "both"], default="both")
    parser.add_argument("--small-iterations", type=int, default=400)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{NUM_LAYERS} layers x [2, num_blocks, {BLOCK_SIZE}, {NUM_KV_HEADS}, {HEAD_SIZE}] bf16, "
          f"{args.cache_gib} GiB of caches on {device}; chunk [2, {NUM_LAYERS}, {CHUNK}, {HIDDEN}] = "
          f"{2 * NUM_LAYERS * CHUNK * HIDDEN * 2 >> 20} MiB; torch threads {torch.get_num_threads()}; "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}\n")
    print("| allocation | slot mapping (or baseline) | op | GB/s | (b) per-layer index_select GB/s | vs (a) | vs (b) |")
    print("|---|---|---|---|---|---|---|")
    allocations = ["per-layer", "pool"] if args.allocation == "both" else [args.allocation]
    for allocation in allocations:
        for row in run(allocation, args.cache_gib, args.iterations, device):
            print(row, flush=True)
    print(f"\nSmall calls, {NUM_LAYERS} layers, one tensor per layer; medians over {args.small_iterations} "
          f"interleaved calls; speedup = median of paired ratios\n")
    print("| op | tokens | module function ms | bound KVTransfer ms | speedup |")
    print("|---|---|---|---|---|")
    for row in small_calls(args.small_iterations, device):
        print(row, flush=True)


if __name__ == "__main__":
    main()
