"""What KV events cost the scheduler: vLLM's real Scheduler with the connector, events off and on, interleaved.

The connector's events add work on the scheduler's thread only (building each saved or loaded
chunk's BlockStored when its save or load is planned, matching the workers' reports each step);
the workers append the keys they wrote to a list, and vLLM publishes on a thread of its own. So
this measures the scheduler: per round, two engines (vLLM's ``Scheduler`` with fake workers on a
file store, ``tests/integrations/vllm/harness.py``), one with vLLM's KV events off and one with them
on, serve the same requests (a batch of prompts stored, then the same prompts again, loaded);
the time inside ``schedule()`` and ``update_from_output()`` of every step is summed per engine.
Rounds alternate which engine goes first; the ratio is the median of per-round ratios.

Run with the vLLM environment: ``.venv-vllm/bin/python -m benchmarks.integrations.vllm.kv_events [--rounds N]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS, PROMPT_TOKENS, CHUNK = 8, 1000, 256  # the harness serves up to 1024 tokens


def serve(model_dir: Path, store_dir: Path, events: bool) -> float:
    """Seconds the scheduler spent stepping: the prompts stored by one engine, then loaded by another."""
    from tests.integrations.vllm.harness import FakeWorker, SchedulerHarness, cache_config, prompt, vllm_config

    spent = 0.0
    for phase in ("store", "load"):
        kv = cache_config(["sliding", "full"], block_size=16, window=512, num_blocks=PROMPTS * PROMPT_TOKENS // 16 + 64)
        config = vllm_config(model_dir, {"store": f"file://{store_dir}", "chunk_size": CHUNK}, kv_events=events,
                             max_batched=4096)
        harness = SchedulerHarness(config, kv)
        if events:
            harness.scheduler.kv_event_publisher.publish = lambda batch: None  # type: ignore[method-assign]
        worker = FakeWorker(config, kv, seed=0)
        for index in range(PROMPTS):
            harness.add(f"{phase}-{index}", prompt(PROMPT_TOKENS, seed=index))
        def timed(inner: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal spent
                begin = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    spent += time.perf_counter() - begin
            return call

        harness.scheduler.schedule = timed(harness.scheduler.schedule)  # type: ignore[method-assign]
        harness.scheduler.update_from_output = timed(  # type: ignore[method-assign]
            harness.scheduler.update_from_output)
        harness.run(worker, max_steps=400)
        harness.step(worker)  # the last writes reported
        worker.side.close()
        harness.connector.shutdown()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    from tests.integrations.vllm.tiny_vllm_models import save_model

    with tempfile.TemporaryDirectory(prefix="kvgroups-events-bench-") as temporary:
        directory = Path(temporary)
        model = save_model("gemma3", directory / "gemma3")
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_index in range(args.rounds + 1):  # the first round warms up, unreported
            order = (False, True) if round_index % 2 else (True, False)
            for events in order:
                seconds = serve(model, directory / f"kv-{round_index}-{events}", events)
                if round_index:
                    times[events].append(seconds)
    ratios = [on / off for on, off in zip(times[True], times[False], strict=True)]
    print(f"vLLM Scheduler with KVGroupsConnector, {PROMPTS} prompts of {PROMPT_TOKENS} tokens stored then "
          f"loaded (sliding + full groups, chunks of {CHUNK}); medians of {args.rounds} interleaved rounds\n")
    print("| KV events | scheduler seconds per round (schedule + update_from_output) | vs events off (paired) |")
    print("|---|---|---|")
    print(f"| off | {statistics.median(times[False]):.3f} | 1.00x |")
    print(f"| on | {statistics.median(times[True]):.3f} | {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
