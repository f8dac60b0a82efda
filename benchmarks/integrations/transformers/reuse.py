"""Time to first token with prefix reuse, against recomputing, on a llama-like model sized for a CPU.

A random-weight llama-like model (8 layers, hidden 1024, 16 heads, 8 KV heads, vocab 32000,
float32) and a 4096-token prompt that shares its first 3840 tokens with a prompt stored before.
In one run, interleaved (recompute, memory, file, Valkey/Redis, a Valkey/Redis Cluster, recompute, ...):
  * time to first token: PrefixCache.prefill (lookup, load, restore, compute the rest, logits of the
    last position) from each tier, against one plain forward of the whole prompt;
  * a miss: PrefixCache.prefill of a new prompt (which computes and saves every chunk) against one
    plain forward;
and for a Gemma-3-like model (5 sliding layers of window 1024 per full layer) the bytes a reuse
reads from the store against the bytes of every layer's chunks.

What the metrics cost: the reuse from memory with and without the metrics' updates (switched off),
in ``--metrics-pairs`` interleaved pairs (each pair's order alternating), and the updates one
prefill makes timed alone.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.support.models import gemma3_like, llama_like
from benchmarks.support.servers import local_cluster, local_redis
from benchmarks.support.unmeasured import Unmeasured
from kvgroups.integrations.transformers import PrefixCache
from kvgroups.store import LoadedEntries
from kvgroups.store.backends.base import ByteStore
from kvgroups.store.entries.codec import view_entry
from kvgroups.store.metrics.counters import Histogram, StoreMetrics

PROMPT, SHARED, CHUNK = 4096, 3840, 256


def plain_prefill(model: Any, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(ids[None], logits_to_keep=1)


def miss_pair(model: Any, cache: PrefixCache, generator: torch.Generator) -> tuple[float, float]:
    """One plain prefill and one PrefixCache prefill that finds nothing stored, of new prompts."""
    fresh, other = (torch.randint(3, 32000, (PROMPT,), generator=generator) for _ in range(2))
    plain = seconds(lambda: plain_prefill(model, fresh))
    missed = cache.prefill(other)
    assert missed.reused_tokens == 0
    cache.flush()
    return plain, missed.seconds


@contextlib.contextmanager
def without_metrics() -> Iterator[None]:
    """Every metrics update of the request path made a no-op (what the store would cost without them)."""
    def nothing(*_: object, **__: object) -> None:
        return None

    patched = [(StoreMetrics, name) for name in ("looked_up", "loaded", "saved")] + [
        (Histogram, "observe"), (ByteStore, "record_read"), (ByteStore, "record_error")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in patched]
    for owner, name in patched:
        setattr(owner, name, nothing)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def metrics_work_seconds(cache: PrefixCache, saves: int, repeats: int = 20000) -> float:
    """The metric updates of one prefill (a lookup, a load, ``saves`` saves, a read), timed alone."""
    stats, store = StoreMetrics(tier="memory", num_groups=len(cache.groups)), cache.chunk_store.store
    begin = time.perf_counter()
    for _ in range(repeats):
        stats.looked_up(PROMPT, {"memory": SHARED}, 0.001)
        stats.loaded(SHARED, 0.01)
        for _ in range(saves):
            stats.saved(1 << 20, 0.01)
        store.record_read(SHARED // CHUNK, SHARED // CHUNK)
    return (time.perf_counter() - begin) / repeats


def metrics_cost(cache: PrefixCache, prompt: torch.Tensor, pairs: int) -> list[tuple[float, float]]:
    """(with metrics, without) TTFT of the reuse from ``cache``, ``pairs`` times, each pair's order alternating."""
    measured = []
    for pair in range(pairs):
        timings: dict[bool, float] = {}
        for metrics_on in ((True, False) if pair % 2 == 0 else (False, True)):
            with contextlib.nullcontext() if metrics_on else without_metrics():
                timings[metrics_on] = cache.prefill(prompt).seconds
        measured.append((timings[True], timings[False]))
    return measured


HIT_PARTS = ("lookup", "read", "check and decode", "copy into the model's cache", "the suffix's forward")


def hit_parts(model: Any, cache: PrefixCache, prompt: torch.Tensor) -> tuple[dict[str, float], int, float]:
    """One hit taken apart, each part timed through the calls ``PrefixCache.prefill`` makes: the seconds
    of each, the entry bytes it moved, and the whole prefill's seconds (measured next, on its own)."""
    chunk_store, binding = cache.chunk_store, cache.binding
    tokens = prompt.numpy().astype("uint32")
    keys = chunk_store.keys(tokens)
    limit = (len(tokens) - 1) // CHUNK
    parts: dict[str, float] = {}
    begin = time.perf_counter()
    boundary = chunk_store.lookup(None, keys=keys[:limit])
    parts["lookup"] = time.perf_counter() - begin
    num_chunks = boundary // CHUNK
    wanted = [chunk_store.entry_info(keys[chunk], group, chunk) for group in range(len(cache.groups))
              for chunk in chunk_store.needed_chunks(group, num_chunks)]
    begin = time.perf_counter()
    values = chunk_store.store.get_many([info.key for info in wanted], max(info.max_entry_bytes for info in wanted))
    parts["read"] = time.perf_counter() - begin
    begin = time.perf_counter()
    entries = {(info.group_index, info.chunk_index): view_entry(value, info)
               for info, value in zip(wanted, values, strict=True) if value is not None}
    parts["check and decode"] = time.perf_counter() - begin
    begin = time.perf_counter()
    restored = binding.restore(LoadedEntries(num_tokens=boundary, entries=entries), capacity_tokens=len(prompt))
    parts["copy into the model's cache"] = time.perf_counter() - begin
    begin = time.perf_counter()
    with torch.no_grad():
        model(input_ids=prompt[None, boundary:], cache=restored, use_cache=True, logits_to_keep=1,
              position_ids=torch.arange(boundary, len(prompt))[None])
    parts["the suffix's forward"] = time.perf_counter() - begin
    moved = sum(len(value) for value in values if value is not None)
    # The parts' buffers and cache go first: alive, they would make the whole prefill's allocations fault
    # in fresh pages (read from a file, the values are 120 MiB of their own).
    del values, entries, restored
    return parts, moved, cache.prefill(prompt).seconds


def copy_seconds(num_bytes: int) -> float:
    """A torch ``copy_`` of ``num_bytes`` between two buffers (both written before, so no page is faulted in
    while it runs), too large to be in the CPU's caches: memory speed."""
    source, target = torch.ones(num_bytes, dtype=torch.uint8), torch.zeros(num_bytes, dtype=torch.uint8)
    return seconds(lambda: target.copy_(source))


def seconds(action: Callable[[], object]) -> float:
    begin = time.perf_counter()
    action()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--metrics-pairs", type=int, default=21, help="pairs of reuse with and without the metrics")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    model = llama_like()
    generator = torch.Generator().manual_seed(1)
    stored = torch.randint(3, 32000, (PROMPT,), generator=generator)
    prompt = torch.cat([stored[:SHARED], torch.randint(3, 32000, (PROMPT - SHARED,), generator=generator)])
    with tempfile.TemporaryDirectory() as root, local_redis(Path(root) / "server") as redis_url, \
            local_cluster(Path(root) / "cluster") as cluster_url:
        urls = {"memory": "memory://?max_bytes=4GiB", "file": f"file://{root}/kv"}
        servers = {"Valkey/Redis": redis_url, "a Valkey/Redis Cluster (3 masters, 3 replicas)": cluster_url}
        urls.update({tier: url for tier, url in servers.items() if url})
        missing = [tier for tier, url in servers.items() if not url]
        caches = {tier: PrefixCache(model, url, chunk_size=CHUNK) for tier, url in urls.items()}
        for cache in caches.values():
            cache.prefill(stored)
            cache.flush()
        reuse: dict[str, list[float]] = {"recompute": [], **{tier: [] for tier in caches}}
        reused: dict[str, int] = {}
        miss: list[tuple[float, float]] = []
        order, shuffle = ["recompute", *caches], random.Random(0)
        for round_ in range(args.rounds):
            # Each round in another order: whatever one leaves behind (a server still busy with the writes
            # before, torch's threads still spinning) falls on a different variant each round.
            shuffle.shuffle(order)
            for name in order:
                if name == "recompute":
                    reuse["recompute"].append(seconds(lambda: plain_prefill(model, prompt)))
                    continue
                result = caches[name].prefill(prompt)
                reuse[name].append(result.seconds)
                reused[name] = result.reused_tokens
                caches[name].flush()
            miss.append(miss_pair(model, caches["memory"], generator))
            print(f"round {round_ + 1}: " + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in reuse.items()),
                  flush=True)
        breakdown: dict[str, list[tuple[dict[str, float], int, float, float]]] = {"memory": [], "file": []}
        for _ in range(args.rounds):
            for tier, rounds in breakdown.items():
                parts, moved, total = hit_parts(model, caches[tier], prompt)
                rounds.append((parts, moved, total, copy_seconds(moved)))
        metrics_pairs = metrics_cost(caches["memory"], prompt, args.metrics_pairs)
        for cache in caches.values():
            cache.close()
    recompute = statistics.median(reuse["recompute"])
    print(f"\n{PROMPT}-token prompt, {SHARED} tokens stored; llama-like 8 layers x hidden 1024, float32, "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} interleaved rounds\n")
    print("| time to first token | reused tokens | seconds | speed-up vs recompute |")
    print("|---|---|---|---|")
    print(f"| recompute (one plain forward) | 0 | {recompute:.2f} | 1.00x |")
    for tier in caches:
        ttft = statistics.median(reuse[tier])
        pairs = statistics.median(r / t for r, t in zip(reuse["recompute"], reuse[tier], strict=True))
        print(f"| reuse from {tier} | {reused[tier]} | {ttft:.2f} | {pairs:.1f}x |")
    unmeasured = Unmeasured()
    for tier in missing:
        print(unmeasured.row(f"reuse from {tier}", "no valkey-server or redis-server installed", columns=4))
    print(f"\nA hit's time to first token taken apart ({SHARED} tokens reused, {PROMPT - SHARED} computed), "
          f"medians of {args.rounds} rounds; the entry bytes moved, and a torch copy_ of as many bytes\n")
    print("| part | memory ms | file ms | MiB/s (memory / file) |")
    print("|---|---|---|---|")
    moved = breakdown["memory"][0][1]
    for part in HIT_PARTS:
        ms = {tier: statistics.median(parts[part] for parts, *_ in rounds) * 1e3 for tier, rounds in breakdown.items()}
        rate = " / ".join(f"{moved / 2**20 / (value / 1e3):.0f}" for value in ms.values()) \
            if part in ("read", "check and decode", "copy into the model's cache") else "-"
        print(f"| {part} | {ms['memory']:.1f} | {ms['file']:.1f} | {rate} |")
    totals = {tier: statistics.median(total for _, _, total, _ in rounds) * 1e3 for tier, rounds in breakdown.items()}
    print(f"| the whole prefill (measured alone) | {totals['memory']:.1f} | {totals['file']:.1f} | - |")
    reference = statistics.median(copy for rounds in breakdown.values() for *_, copy in rounds) * 1e3
    suffix = statistics.median(parts["the suffix's forward"] for rounds in breakdown.values() for parts, *_ in rounds)
    print(f"\nEntries read: {moved / 2**20:.1f} MiB; a copy_ of as many bytes: {reference:.1f} ms. The suffix's "
          f"forward alone bounds a hit's speed-up at {recompute / suffix:.1f}x (recompute {recompute:.2f} s / "
          f"suffix {suffix:.2f} s).")
    with_metrics, off = [on for on, _ in metrics_pairs], [without for _, without in metrics_pairs]
    cost = statistics.median(on / without for on, without in metrics_pairs)
    work = metrics_work_seconds(caches["memory"], saves=1)
    print(f"\nMetrics: reuse from memory with them / without them, median of {len(metrics_pairs)} interleaved "
          f"pairs: {cost:.3f}x ({statistics.median(with_metrics):.3f} s vs {statistics.median(off):.3f} s); the "
          f"updates of one prefill timed alone: {work * 1e6:.1f} us, {work / statistics.median(with_metrics):.5%} of "
          "its time to first token")

    def report_miss(what: str, pairs: list[tuple[float, float]]) -> None:
        ratio = statistics.median(ours / plain for plain, ours in pairs)
        plain_s, ours_s = statistics.median(p for p, _ in pairs), statistics.median(o for _, o in pairs)
        print(f"| {what} | {plain_s:.2f} | {ours_s:.2f} | {ratio:.2f}x |")

    print(f"\nA miss: PrefixCache.prefill of a new prompt (computes and saves all {PROMPT // CHUNK} chunks) vs one "
          f"plain prefill\n")
    print("| model | plain s | PrefixCache s | ratio |")
    print("|---|---|---|---|")
    report_miss("llama-like (every layer keeps every token: one forward, then packed)", miss)
    gemma = gemma3_like()
    with PrefixCache(gemma, "memory://?max_bytes=4GiB", chunk_size=CHUNK) as cache:
        report_miss("Gemma-3-like (sliding layers: one chunk per forward)",
                    [miss_pair(gemma, cache, generator) for _ in range(args.rounds)])
        cache.prefill(stored)
        cache.flush()
        before = list(cache.chunk_store.stats.bytes_read)
        result = cache.prefill(prompt)
        read = sum(cache.chunk_store.stats.bytes_read) - sum(before)
        keys = cache.chunk_store.keys(stored)
        store = cache.chunk_store.store
        every = sum(store.size_of(cache.chunk_store.entry_key(key, group)) or 0
                    for key in keys[: result.reused_tokens // CHUNK] for group in range(len(cache.groups)))
    print(f"\nGemma-3-like (5 sliding layers, window 1024, per full layer): reusing {result.reused_tokens} tokens read "
          f"{read / 2**20:.1f} MiB from the store; every layer's chunks of that prefix are {every / 2**20:.1f} MiB "
          f"({read / every:.2f} of them)")
    unmeasured.exit()


if __name__ == "__main__":
    main()
