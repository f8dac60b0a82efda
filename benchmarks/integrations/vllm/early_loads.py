"""Loads started while the running batch is full (vLLM 0.34's ``max_num_inflight_kv_loads`` and the
connector's ``may_load_async``): how long a hit request waits, driven through vLLM's real Scheduler.

vLLM 0.34 has no CPU build, so no engine of it runs here: this drives its ``Scheduler`` with the
connector and fake caches (``tests/integrations/vllm/harness.py``, as ``make test-vllm034`` does), each
engine step standing in for the model with ``--step-ms`` of sleep; the connector's loads are real
(a file store, chunks of 32 tokens read, checked and copied into the fake caches within the step).
A server first serves ``--hits`` conversations of ``--prompt`` tokens (saved; vLLM's prefix cache
off, so they leave it); then ``--slots`` requests take every running slot and decode for
``--busy`` steps; then the conversations come back, each followed by a prompt the store never saw
(a miss), all while the batch is full. Variants, in one process, each round's order reversed from
the last, ``--rounds`` times: vLLM's default (loads start only once a slot is free), and
``max_num_inflight_kv_loads`` of half the slots and of all of them (hits load at once, that many at a
time). Reported: the hits' and the misses' wait from arrival to their first scheduled step (ms and
steps, medians over requests, then over rounds), the medians of the per-round ratios against the
default, and the steps to finish everything.

Run with the vLLM 0.34 environment: ``.venv-vllm034/bin/python -m benchmarks.integrations.vllm.early_loads``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import vllm
from vllm.config import SchedulerConfig

from tests.integrations.vllm.harness import (
    FakeWorker,
    SchedulerHarness,
    cache_config,
    file_store,
    prompt,
    vllm_config,
)
from tests.integrations.vllm.tiny_vllm_models import save_model

KINDS = ["sliding", "full"]


@dataclasses.dataclass
class Round:
    hit_ms: float
    miss_ms: float
    hit_steps: float
    miss_steps: float
    total_steps: int
    loaded_tokens: int


def one_round(model: Path, directory: Path, arguments: argparse.Namespace, inflight: int | None) -> Round:
    kv = cache_config(KINDS, num_blocks=arguments.blocks)
    config = vllm_config(model, file_store(directory), max_num_seqs=arguments.slots, inflight_kv_loads=inflight)
    harness, worker = SchedulerHarness(config, kv), FakeWorker(config, kv)
    conversations = [prompt(arguments.prompt, seed=100 + index) for index in range(arguments.hits)]
    for index, tokens in enumerate(conversations):  # served once: saved, then gone from vLLM
        harness.add(f"earlier-{index}", tokens, max_tokens=1)
    harness.run(worker, max_steps=1000)
    for index in range(arguments.slots):
        harness.add(f"busy-{index}", prompt(64, seed=500 + index), max_tokens=arguments.busy)
    harness.step(worker)

    def forward(step: Any) -> None:
        time.sleep(arguments.step_ms / 1000)

    arrived: dict[str, tuple[int, float]] = {}
    for index, tokens in enumerate(conversations):
        for request_id, request_tokens in ((f"hit-{index}", tokens),
                                           (f"miss-{index}", prompt(arguments.prompt, seed=900 + index))):
            harness.add(request_id, request_tokens, max_tokens=4)
            arrived[request_id] = (0, time.perf_counter())
    started: dict[str, tuple[int, float, int]] = {}
    steps = 0
    while harness.scheduler.has_unfinished_requests():
        step = harness.step(worker, forward=forward)
        steps += 1
        now = time.perf_counter()
        for request_id, computed in step.new().items():
            if request_id in arrived:
                started[request_id] = (steps, now, computed)
        if steps > 5000:
            raise RuntimeError("the scheduler did not finish the requests in 5000 steps")
    worker.side.flush()

    def waits(kind: str) -> tuple[float, float]:
        ms = [1000 * (started[name][1] - arrived[name][1]) for name in arrived if name.startswith(kind)]
        counts = [started[name][0] for name in arrived if name.startswith(kind)]
        return statistics.median(ms), statistics.median(counts)

    hit_ms, hit_steps = waits("hit-")
    miss_ms, miss_steps = waits("miss-")
    loaded = sum(started[name][2] for name in started if name.startswith("hit-"))
    return Round(hit_ms, miss_ms, hit_steps, miss_steps, steps, loaded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slots", type=int, default=4, help="running slots (max_num_seqs)")
    parser.add_argument("--hits", type=int, default=4, help="conversations coming back (each followed by a miss)")
    parser.add_argument("--prompt", type=int, default=800, help="tokens per prompt")
    parser.add_argument("--busy", type=int, default=24, help="decode steps of the requests filling the batch")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the model's time per engine step")
    parser.add_argument("--blocks", type=int, default=512, help="KV blocks of 16 tokens")
    arguments = parser.parse_args()
    if "max_num_inflight_kv_loads" not in {field.name for field in dataclasses.fields(SchedulerConfig)}:
        raise SystemExit(f"vLLM {vllm.__version__} has no max_num_inflight_kv_loads (0.34 on): run with "
                         f".venv-vllm034/bin/python")
    logging.disable(logging.WARNING)
    variants: dict[str, int | None] = {"vLLM's default": None}
    for inflight in sorted({max(1, arguments.slots // 2), arguments.slots}):
        variants[f"max_num_inflight_kv_loads={inflight}"] = inflight
    results: dict[str, list[Round]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="kvgroups-early-") as directory:
        model = save_model("gemma3", Path(directory) / "model")
        for number in range(arguments.rounds):
            order = list(variants.items()) if number % 2 == 0 else list(reversed(variants.items()))
            for name, inflight in order:
                store = Path(directory) / f"round-{number}-{inflight}"
                results[name].append(one_round(model, store, arguments, inflight))
    default = results["vLLM's default"]
    print(f"vLLM {vllm.__version__}; {arguments.slots} running slots, each busy {arguments.busy} steps; "
          f"{arguments.hits} returning conversations and {arguments.hits} misses of {arguments.prompt} tokens arrive "
          f"while the batch is full, alternating; {arguments.step_ms:g} ms per step; {arguments.rounds} rounds\n")
    print("| variant | hit waits, ms | hit waits, steps | miss waits, ms | miss waits, steps | steps to finish "
          "| hit wait vs default | miss wait vs default | tokens loaded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rounds in results.items():
        hit_ratio = statistics.median(b.hit_ms / a.hit_ms for a, b in zip(default, rounds, strict=True))
        miss_ratio = statistics.median(b.miss_ms / a.miss_ms for a, b in zip(default, rounds, strict=True))
        print(f"| {name} | {statistics.median(r.hit_ms for r in rounds):.0f} | "
              f"{statistics.median(r.hit_steps for r in rounds):g} | "
              f"{statistics.median(r.miss_ms for r in rounds):.0f} | "
              f"{statistics.median(r.miss_steps for r in rounds):g} | "
              f"{statistics.median(r.total_steps for r in rounds):g} | {hit_ratio:.2f}x | {miss_ratio:.2f}x | "
              f"{rounds[0].loaded_tokens} |")
    if len({rounds[0].loaded_tokens for rounds in results.values()}) != 1 or not default[0].loaded_tokens:
        raise SystemExit("the variants loaded different tokens: the comparison is void")


if __name__ == "__main__":
    main()
