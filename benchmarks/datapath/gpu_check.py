"""``make gpu-check``: the data path and the connector's copy discipline on a CUDA GPU, as one table.

Run on a machine with a CUDA GPU (at most a few minutes); without one it says so in one line and exits 0.
Rows:
  * kernels: the compiled Triton kernels against the torch path, byte for byte, pack and unpack, for every
    layout the connector accepts: vLLM's pages with NHD (LBNHC) and HND (LBHNC) strides, bf16 and fp8,
    padded pages (a block stride past the page), diff-KV pages, MLA latents and recurrent states;
  * speed: pack and unpack of block-aligned 256-token chunks (32 layers x 8 heads x 128, bf16) between
    device caches and pinned host buffers, against ``copy_`` of the same bytes, medians of paired ratios, end
    to end and with the stream kept busy while the calls are issued (the copies alone), and the host
    microseconds of a call (its launch included);
  * completion: a load on the load stream, delayed by a long kernel, is not reported finished before its
    event completed, and the caches hold its bytes once it is;
  * synchronizations: what a save (gather, copy to pinned memory, event) makes the launching thread wait
    for, counted with ``torch.cuda.set_sync_debug_mode``;
  * vLLM engines (``benchmarks.integrations.vllm.gpu_engines``): a tiny llama-like model and a qwen3-next-like
    hybrid on FLASH_ATTN and FLASHINFER, a prefix stored by one process reused by another with identical greedy
    tokens and logprobs, and its time to first token against vLLM's own prefix cache and against computing it;
    skipped where vLLM is not installed (the lent GPU machines have none). ``--engines none`` leaves them out.
``--device cpu`` runs the kernel rows on the CPU (Triton under its interpreter, small shapes), and with
``--engines llama`` the llama engine row on vLLM's CPU build: that part runs in ``make test``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kvgroups import KVLayerGroupsManager, KVLayout, RecurrentState
from kvgroups.datapath.streams import CopyStream
from kvgroups.integrations.vllm.loads import BackgroundLoads  # the worker's loads; imports no vLLM
from kvgroups.transfer import KVTransfer

Row = tuple[str, str, str]


def _caches(case: str, device: torch.device, dtype: torch.dtype, layers: int, blocks: int,
            generator: torch.Generator) -> tuple[dict[str, Any], KVLayerGroupsManager]:
    """One group's caches on ``device`` in the layout ``case`` names, as vLLM 0.32 hands them to a connector."""
    heads, block, head = 2, 16, 64

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dtype).to(device)

    values: dict[str, Any] = {}
    layouts: dict[str, KVLayout] = {}
    specs: dict[str, Any] = {}
    value_head_size = None
    for index in range(layers):
        name = f"layers.{index}"
        if case == "vllm NHD (LBNHC)":
            values[name] = random(blocks, block, heads, 2 * head).permute(0, 2, 1, 3)
        elif case == "vllm HND (LBHNC)":
            values[name] = random(blocks, heads, block, 2 * head)
        elif case == "vllm padded pages":  # each block's page followed by 256 bytes vLLM left unused
            page = heads * block * 2 * head
            raw = random(blocks, page + 256 // dtype.itemsize)
            values[name] = raw[:, :page].view(blocks, block, heads, 2 * head).permute(0, 2, 1, 3)
        elif case == "vllm diff-KV (96+32)":
            values[name], value_head_size = random(blocks, block, heads, 96 + 32).permute(0, 2, 1, 3), 32
        elif case == "mla latent":
            values[name] = random(blocks, block, 576)
        else:  # recurrent: a conv state and an SSM state per sequence slot
            values[name] = (random(blocks, 3, 64), random(blocks, 4, 8, 16))
            specs[name] = RecurrentState(state_shapes=((3, 64), (4, 8, 16)))
            continue
        layouts[name] = KVLayout.MLA if case == "mla latent" else KVLayout.VLLM
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, specs or None, layout=layouts or None, value_head_size=value_head_size)
    return values, manager


CASES = ("vllm NHD (LBNHC)", "vllm HND (LBHNC)", "vllm padded pages", "vllm diff-KV (96+32)", "mla latent",
         "recurrent states")


def _bits(value: Any) -> list[torch.Tensor]:
    tensors = value if isinstance(value, tuple) else (value,)
    return [tensor.contiguous().view(torch.uint8).cpu() for tensor in tensors]


def kernel_rows(device: torch.device, layers: int = 4, blocks: int = 64, num_slots: int = 300) -> list[Row]:
    """Triton against the torch path, pack and unpack, byte for byte, for each layout and dtype."""
    rows = []
    for case in CASES:
        for dtype in (torch.bfloat16, torch.float8_e4m3fn) if case != "recurrent states" else (torch.float32,):
            generator = torch.Generator().manual_seed(0)
            values, manager = _caches(case, device, dtype, layers, blocks, generator)
            recurrent = case == "recurrent states"
            slots = None if recurrent else torch.randperm(blocks * 16, generator=generator)[:num_slots].to(device)
            states = [blocks - 1, 1, blocks // 2] if recurrent else None
            packed = {kernel: KVTransfer(manager, values, kernel=kernel).pack(slots, state_indices=states)
                      for kernel in ("triton", "torch")}
            same_pack = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                            for a, b in zip(packed["triton"], packed["torch"], strict=True))
            written = {}
            for kernel in ("triton", "torch"):
                targets, _ = _caches(case, device, dtype, layers, blocks, torch.Generator().manual_seed(1))
                KVTransfer(manager, targets, kernel=kernel).unpack(packed["torch"], slots, state_indices=states)
                written[kernel] = [bits for value in targets.values() for bits in _bits(value)]
            same_unpack = all(torch.equal(a, b) for a, b in zip(written["triton"], written["torch"], strict=True))
            verdict = "byte-exact" if same_pack and same_unpack else (
                f"DIFFERS (pack {'ok' if same_pack else 'differs'}, unpack {'ok' if same_unpack else 'differs'})")
            rows.append((f"triton = torch path: {case}", str(dtype).replace("torch.", ""), verdict))
    return rows


def _median_ratio(baseline: Callable[[], None], variant: Callable[[], None], rounds: int, *,
                  preload: bool = False) -> tuple[float, float, float]:
    """Median of baseline time / variant time over interleaved rounds, the variant's median seconds, and the
    variant call's median host microseconds. ``preload``: the stream is kept busy (a sleep kernel) while the
    calls are issued, so the events time the copies alone, not the host work before their launch."""
    ratios, seconds, host = [], [], []
    for round_index in range(rounds + 2):
        timed = []
        for action in (baseline, variant) if round_index % 2 else (variant, baseline):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if preload:
                torch.cuda._sleep(20_000_000)  # longer than any call's host work
            start.record()
            begin = time.perf_counter()
            action()
            issued = time.perf_counter() - begin
            end.record()
            end.synchronize()
            timed.append((action, start.elapsed_time(end) / 1000, issued))
        if round_index < 2:
            continue  # warm-up
        times = {action: elapsed for action, elapsed, _ in timed}
        ratios.append(times[baseline] / times[variant])
        seconds.append(times[variant])
        host.append(next(issued for action, _, issued in timed if action is variant) * 1e6)
    return statistics.median(ratios), statistics.median(seconds), statistics.median(host)


def speed_rows(device: torch.device, rounds: int = 21) -> list[Row]:
    """Pack into and unpack from pinned host memory against copy_ of the same bytes: end to end (the call's
    host work included), the copies alone (the stream kept busy while the calls are issued), and the host
    microseconds of a call."""
    layers, heads, head, block, chunk, blocks = 32, 8, 128, 16, 256, 2048
    values = {f"layers.{index}": torch.randn(blocks, block, heads, 2 * head, device=device).to(torch.bfloat16)
              .permute(0, 2, 1, 3) for index in range(layers)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, layout=KVLayout.VLLM)
    (group,) = manager.kv_layer_groups
    transfer = KVTransfer(manager, values)
    pinned = torch.empty(group.chunk_shape(chunk), dtype=torch.bfloat16).pin_memory()
    staging = [torch.empty(group.chunk_bytes(chunk), dtype=torch.uint8, device=device)]
    source = torch.empty(group.chunk_bytes(chunk), dtype=torch.uint8, device=device)
    host = pinned.view(-1).view(torch.uint8)
    order = torch.randperm(blocks - chunk // block)[:1]
    slots = (torch.arange(chunk) + int(order[0]) * block).numpy()  # on the host, as the connector passes them
    gigabytes = group.chunk_bytes(chunk) / 1e9
    rows: list[Row] = []
    for preload, how in ((False, "end to end"), (True, "copies alone")):
        pack_ratio, pack_seconds, pack_host = _median_ratio(
            lambda: host.copy_(source, non_blocking=True),
            lambda: transfer.pack(slots, out=[pinned], staging=staging, synchronize=False), rounds, preload=preload)
        unpack_ratio, unpack_seconds, unpack_host = _median_ratio(
            lambda: source.copy_(host, non_blocking=True),
            lambda: transfer.unpack([pinned], slots, synchronize=False), rounds, preload=preload)
        rows += [(f"pack to pinned host / copy_ D2H, {how}", f"{gigabytes * 1000:.0f} MB chunk",
                  f"{pack_ratio:.2f} ({gigabytes / pack_seconds:.1f} GB/s)"),
                 (f"unpack from pinned host / copy_ H2D, {how}", f"{gigabytes * 1000:.0f} MB chunk",
                  f"{unpack_ratio:.2f} ({gigabytes / unpack_seconds:.1f} GB/s)")]
        if preload:
            rows.append(("host work per call (pack, unpack)", "launch included",
                         f"{pack_host:.0f} µs, {unpack_host:.0f} µs"))
    return rows


def completion_rows(device: torch.device) -> list[Row]:
    """A load delayed on its stream is not reported before its event; then its bytes are in the caches."""
    values, manager = _caches("vllm NHD (LBNHC)", device, torch.bfloat16, 4, 64, torch.Generator().manual_seed(2))
    transfer = KVTransfer(manager, values)
    slots = torch.arange(256, device=device)
    chunk = [torch.randn(manager.kv_layer_groups[0].chunk_shape(256)).to(torch.bfloat16).pin_memory()]
    stream = CopyStream(device)
    loads = BackgroundLoads(bytearray, threads=1)

    def job(buffer: bytearray) -> tuple[bool, Any]:
        with stream.launching():
            torch.cuda._sleep(2_000_000_000)  # about a second of a busy stream before the copies
            transfer.unpack(chunk, slots, synchronize=False)
            return True, stream.record()

    loads.submit("request", job)
    time.sleep(0.2)
    early = loads.take()
    loads.wait()
    late = loads.take()
    landed = torch.equal(transfer.pack(slots)[0].cpu().view(torch.uint8), chunk[0].view(torch.uint8))
    loads.close()
    ok = early == (set(), set()) and late == ({"request"}, set()) and landed
    return [("a load reported only after its event", "delayed ~1 s on its stream",
             "yes" if ok else f"NO (before: {early}, after: {late}, bytes landed: {landed})")]


def sync_rows(device: torch.device) -> list[Row]:
    """Synchronizations the launching thread makes for one save, counted by torch's sync debug mode."""
    values, manager = _caches("vllm NHD (LBNHC)", device, torch.bfloat16, 4, 64, torch.Generator().manual_seed(3))
    (group,) = manager.kv_layer_groups
    transfer = KVTransfer(manager, values)
    stream = CopyStream(device)
    pinned = torch.empty(group.chunk_shape(256), dtype=group.dtype).pin_memory()
    staging = [torch.empty(group.chunk_bytes(256), dtype=torch.uint8, device=device)]
    slots = torch.arange(256)
    torch.cuda._sleep(1_000_000_000)  # the engine's forward, still running
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with stream.launching(after_engine=True):
                transfer.pack(slots, out=[pinned], staging=staging, synchronize=False)
                done = stream.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    done.synchronize()
    # torch's own notice that the debug mode is a prototype is not a synchronization (H100, torch 2.11:
    # it was the one warning a save raised, and an earlier spelling of this row counted it)
    found = [str(warning.message).split("\n")[0] for warning in caught
             if "called a synchronizing" in str(warning.message)]
    return [("synchronizations on the engine thread per save", "gather + D2H + event",
             "0" if not found else f"NO: {len(found)} ({found[0][:60]})")]


def engine_rows(backends: tuple[str, ...], models: tuple[str, ...] | None = None) -> list[Row]:
    """Real vLLM engines on ``backends`` reusing a prefix across processes (``gpu_engines``)."""
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None:
        return [("vLLM engines (llama-like, qwen3-next-like)", ", ".join(backends),
                 "skipped: vLLM (with transformers) is not installed here")]
    from benchmarks.integrations.vllm.gpu_engines import MODELS
    from benchmarks.integrations.vllm.gpu_engines import engine_rows as run_engines

    return run_engines(backends, models or tuple(MODELS))


def print_table(rows: list[Row], device: str) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    print(f"gpu-check on {device}")
    for row in (("check", "what", "result"), *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for the kernel rows only")
    parser.add_argument("--engines", choices=("all", "none", "llama", "qwen3_next"), default="all",
                        help="which vLLM engine rows to run (with --device cpu: none unless asked, on CPU_ATTN)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        rows = kernel_rows(torch.device("cpu"), layers=2, blocks=4, num_slots=12)
        if args.engines not in {"all", "none"}:
            rows += engine_rows(("CPU_ATTN",), (args.engines,))
        print_table(rows, "cpu (Triton interpreted)")
        return _exit_code(rows)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing checked")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [*kernel_rows(device), *speed_rows(device), *completion_rows(device), *sync_rows(device)]
    if args.engines != "none":
        rows += engine_rows(("FLASH_ATTN", "FLASHINFER"), None if args.engines == "all" else (args.engines,))
    print_table(rows, torch.cuda.get_device_name(device))
    return _exit_code(rows)


def _exit_code(rows: list[Row]) -> int:
    return 0 if not any("DIFFERS" in row[2] or row[2].startswith("NO") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
