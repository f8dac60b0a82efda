"""SGLang's HiCache L3: kvgroups' backend against SGLang's own file backend, and its Redis tier against
redis-benchmark, in one run: ``.venv-sglang/bin/python -m benchmarks.integrations.sglang.storage`` (``make bench``).

Pages are an SGLang MHA host pool's (32 layers, 8 KV heads of 128 dims, bfloat16, 32-token pages: 4 MiB a
page on one tensor-parallel rank of a Llama-3.1-8B), written and read through each backend's own calls,
as SGLang's storage threads make them, from the host pool and into it: ``batch_set`` / ``batch_get`` on
flat pages (SGLang's generic data path, which copies each page it gets into the host pool) and, for
kvgroups, ``batch_set_v1`` / ``batch_get_v1`` on the host pool (``interface_v1``).

- file: kvgroups' file tier and ``HiCacheFile`` on the same pages, in directories on the same disk, the
  variants interleaved (A, B, C, then B, C, A, ...: each round starts with another) over rounds of fresh
  keys; the ratio is the median over rounds of kvgroups' pages per second / HiCacheFile's (1.00 = as fast).
- redis: kvgroups' Redis tier on a server started here, against ``redis-benchmark`` SET and GET of values
  of the page's size on the same server, 16 pipelined (``-P 16``: a batch asked at once), on one connection
  and on four (kvgroups spreads a large batch over up to 4), alternating rounds; the ratio is the median
  over rounds of kvgroups' pages per second / redis-benchmark's requests per second.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.integrations.sglang import torchvision_stand_in

torchvision_stand_in.install()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from benchmarks.support.servers import installed_server, running_server  # noqa: E402
from benchmarks.support.unmeasured import Unmeasured  # noqa: E402
from kvgroups.integrations.sglang import KVGroupsHiCacheStorage  # noqa: E402

UNMEASURED = Unmeasured()
PIPELINE = 16  # replies redis-benchmark asks for before reading the first (-P), as a batch of pages is asked
LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 32


def host_pool(pages: int, seed: int) -> Any:
    device = MHATokenToKVPool(size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS,
                              head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 1, 0, PAGE, "layer_first",
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS, write_back_staging=device.hicache_write_back_staging)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def config(extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="bench/llama-8b", extra_config=extra)


def kvgroups_backend(store: str, pool: Any) -> Any:
    backend = KVGroupsHiCacheStorage(config({"store": store}), {})
    backend.register_mem_pool_host(pool)
    return backend


def sglang_file_backend(directory: Path, pool: Any) -> Any:
    backend = HiCacheFile(config({"file_storage_path": str(directory)}))
    backend.register_mem_pool_host(pool)
    return backend


def round_trip(backend: Any, pool: Any, keys: list[str], path: str) -> tuple[float, float]:
    """Seconds to write ``keys``' pages, then to read them back (each call as SGLang's thread makes it)."""
    count = len(keys)
    indices = torch.arange(count * PAGE)
    begin = time.perf_counter()
    if path == "v1":
        assert all(backend.batch_set_v1(keys, indices))
    else:
        assert backend.batch_set(keys, [pool.get_data_page(page * PAGE) for page in range(count)])
    written = time.perf_counter()
    if path == "v1":
        assert all(backend.batch_get_v1(keys, indices))
    else:  # as SGLang's _generic_page_get: flat pages, then each copied into the host pool
        targets = [pool.get_dummy_flat_data_page() for _ in range(count)]
        got = backend.batch_get(keys, targets)
        assert all(page is not None for page in got)
        for page, data in enumerate(got):
            pool.set_from_flat_data_page(page * PAGE, data)
    return written - begin, time.perf_counter() - written


def file_table(rounds: int, count: int, directory: Path) -> list[str]:
    pool = host_pool(count, seed=1)
    ours = {path: kvgroups_backend(f"file://{directory}/kvgroups-{path}", pool) for path in ("generic", "v1")}
    theirs = sglang_file_backend(directory / "hicache-file", pool)
    times: dict[str, list[tuple[float, float]]] = {"kvgroups generic": [], "kvgroups v1": [], "HiCacheFile": []}
    for number in range(rounds + 1):  # round 0 warms up
        keys = [f"{number:08x}{page:056x}" for page in range(count)]
        variants = [("kvgroups generic", ours["generic"], "generic"), ("HiCacheFile", theirs, "generic"),
                    ("kvgroups v1", ours["v1"], "v1")]
        # Each round starts with another variant: the disk's write-back of one variant's pages slows
        # whichever writes next, and no variant should always be the one that follows another.
        variants = variants[number % 3:] + variants[:number % 3]
        measured = {name: round_trip(backend, pool, keys, path) for name, backend, path in variants}
        if number:
            for name, pair in measured.items():
                times[name].append(pair)
    page_mib = pool.get_data_page(0).numel() * 2 / 2**20
    rows = [f"| variant ({page_mib:.0f} MiB pages, {count} a batch) | write pages/s | read pages/s | "
            f"write vs HiCacheFile | read vs HiCacheFile |", "|---|---|---|---|---|"]
    for name, pairs in times.items():
        write_ratio = statistics.median(b[0] / a[0] for a, b in zip(pairs, times["HiCacheFile"], strict=True))
        read_ratio = statistics.median(b[1] / a[1] for a, b in zip(pairs, times["HiCacheFile"], strict=True))
        rows.append(f"| {name} | {count / statistics.median(w for w, _ in pairs):.0f} | "
                    f"{count / statistics.median(r for _, r in pairs):.0f} | {write_ratio:.2f} | {read_ratio:.2f} |")
    return rows


def redis_benchmark(port: int, page_bytes: int, count: int, clients: int) -> dict[str, float]:
    """Requests per second of redis-benchmark's SET and GET of ``page_bytes`` values, 16 pipelined (as a batch
    of pages is asked at once), on ``clients`` connections."""
    command = shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")
    if command is None:
        raise RuntimeError("neither valkey-benchmark nor redis-benchmark is installed")
    output = subprocess.run([command, "-p", str(port), "-t", "set,get", "-n", str(count), "-d", str(page_bytes),
                             "-c", str(clients), "-P", str(PIPELINE), "-q"], capture_output=True, text=True,
                            timeout=600, check=True).stdout
    found = {name.lower(): float(rate) for name, rate in re.findall(r"(SET|GET): ([\d.]+) requests per second",
                                                                   output.replace("\r", "\n"))}
    if set(found) != {"set", "get"}:
        raise RuntimeError(f"unexpected redis-benchmark output: {output[-300:]!r}")
    return found


def redis_table(rounds: int, count: int, directory: Path) -> list[str]:
    if installed_server() is None:
        return [UNMEASURED.row("redis", "no valkey-server or redis-server installed", columns=5)]
    pool = host_pool(count, seed=2)
    page_bytes = pool.get_data_page(0).numel() * 2
    anchors = {clients: f"redis-benchmark -P {PIPELINE} -c {clients}" for clients in (1, 4)}
    with running_server(directory / "valkey") as server:
        ours = kvgroups_backend(server.url, pool)
        pairs: list[tuple[tuple[float, float], dict[int, dict[str, float]]]] = []
        for number in range(rounds + 1):
            keys = [f"{number:08x}{page:056x}" for page in range(count)]
            measured = round_trip(ours, pool, keys, "v1")
            theirs = {clients: redis_benchmark(server.port, page_bytes, max(count, PIPELINE * clients), clients)
                      for clients in anchors}
            if number:
                pairs.append((measured, theirs))
            ours.store.clear()
    rows = [f"| variant ({page_bytes / 2**20:.0f} MiB values, {count} a batch) | write pages/s | read pages/s | "
            f"write vs {anchors[1]} | read vs {anchors[1]} | write / read vs {anchors[4]} |",
            "|---|---|---|---|---|---|"]
    ours_rates = [(count / write, count / read) for (write, read), _ in pairs]

    def ratio(column: int, op: str, clients: int) -> float:
        return statistics.median(rate[column] / theirs[clients][op]
                                 for rate, (_, theirs) in zip(ours_rates, pairs, strict=True))

    rows.append(f"| kvgroups Redis tier (v1) | {statistics.median(w for w, _ in ours_rates):.0f} | "
                f"{statistics.median(r for _, r in ours_rates):.0f} | {ratio(0, 'set', 1):.2f} | "
                f"{ratio(1, 'get', 1):.2f} | {ratio(0, 'set', 4):.2f} / {ratio(1, 'get', 4):.2f} |")
    for clients, name in anchors.items():
        rows.append(f"| {name} | {statistics.median(t[clients]['set'] for _, t in pairs):.0f} | "
                    f"{statistics.median(t[clients]['get'] for _, t in pairs):.0f} | | | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--pages", type=int, default=16, help="pages a batch (SGLang asks up to 128)")
    parser.add_argument("--only", choices=("file", "redis"), default=None, help="one table alone")
    parser.add_argument("--dir", type=Path, default=None, help="where the file stores live (default: a temporary "
                        "directory under /var/tmp, a disk rather than a tmpfs)")
    arguments = parser.parse_args()
    base = arguments.dir or Path("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=base) as directory:
        if arguments.only != "redis":
            for row in file_table(arguments.rounds, arguments.pages, Path(directory)):
                print(row)
            print()
        if arguments.only != "file":
            for row in redis_table(arguments.rounds, arguments.pages, Path(directory)):
                print(row)
    UNMEASURED.exit()


if __name__ == "__main__":
    main()
