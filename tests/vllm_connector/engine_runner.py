"""Run vLLM engines in a fresh process, phase after phase, and write what each request produced.

``python -m tests.vllm_connector.engine_runner JOB.json`` where the job is ``{"model": dir, "dtype": ...,
"phases": [{"connector": extra_config or null, "requests": [{"prompt_token_ids": [...],
"cache_salt": ...}], "before": {"stop_pid": pid} (optional)}], "out": path}``. Consecutive phases
with the same connector settings share one engine. Greedy, with logprobs, vLLM's prefix cache off.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def _engine(job: dict[str, Any], connector: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {}
    if connector is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=connector, kv_load_failure_policy="recompute",
        )
    return LLM(model=job["model"], dtype=job.get("dtype", "float32"), block_size=job.get("block_size", 32),
               enforce_eager=True, enable_prefix_caching=False, max_model_len=job.get("max_model_len", 2048),
               max_num_seqs=4, max_num_batched_tokens=job.get("max_num_batched_tokens", 2048), seed=0, **extra)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=2, ignore_eos=True)
    results: list[dict[str, Any]] = []
    engine, engine_settings = None, object()
    for phase in job["phases"]:
        before = phase.get("before", {})
        if "stop_pid" in before:
            os.kill(before["stop_pid"], signal.SIGKILL)
            time.sleep(0.2)
        if phase.get("connector") != engine_settings:
            engine = None
            gc.collect()
            engine_settings = phase.get("connector")
            engine = _engine(job, engine_settings)
        assert engine is not None
        started = time.perf_counter()
        outputs = engine.generate(phase["requests"], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        results.append({
            "seconds": elapsed,
            "outputs": [{
                "token_ids": list(output.outputs[0].token_ids),
                "logprobs": [entry[token].logprob for token, entry in
                             zip(output.outputs[0].token_ids, output.outputs[0].logprobs, strict=True)],
                "num_cached_tokens": output.num_cached_tokens,
            } for output in outputs],
        })
        Path(job["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
