"""gpu-check's engine rows: real vLLM engines reusing a prefix another process stored, and their time to first token.

Per model (a tiny random-weight llama-like model, a qwen3-next-like hybrid of gated-DeltaNet and
full attention) and attention backend, two engines run one after the other, each in its own
process (``tests.integrations.vllm.engine_runner``), on one file store, both with vLLM's defaults
(its prefix cache on; for the hybrid, so recurrent states on vLLM's block grid):

* the first, with the connector, computes the prompt (a miss: its greedy tokens and logprobs are
  the reference), which stores it;
* the second, a fresh process, serves the prompt from the store and must give the same tokens and
  logprobs; then, ``max_tokens=1``: a stored prompt (a store hit), the same prompt again (vLLM's own
  prefix cache), and a fresh prompt of the same length with the connector off (computed).

A hybrid's attention block size is vLLM's choice (it sizes blocks to hold a state), and its chunk
follows it (``chunk_size`` left out). Any failure is a row saying so.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any

OFF = {"kvgroups": {"load": False, "save": False}}
Row = tuple[str, str, str]
# Per model: the runner's settings. The hybrid's SSM states in float32, as vLLM's CPU build keeps them.
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"dtype": "bfloat16", "chunk": 64, "prompt": 300},
    "qwen3_next": {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32", "prompt": 700},
}


def _prompt(seed: int, length: int) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": [4 + (index * 37 + seed * 101 + 11) % 508 for index in range(length)]}]


def _run(job: dict[str, Any], directory: Path, name: str) -> list[dict[str, Any]]:
    import torch

    from tests.integrations.vllm.engine_runner import run_job

    try:  # forked from the engine zygote on the CPU; CUDA does not survive a fork, each engine a fresh interpreter
        return run_job(job, directory, name, multiprocess=False, forked=not torch.cuda.is_available())
    except RuntimeError as error:  # the row says the last line the engine wrote
        lines = [line for line in str(error).splitlines() if line.strip()]
        raise RuntimeError(lines[-1][-160:]) from None


def engine_row(model: str, backend: str, directory: Path) -> Row:
    """Two engines, one store: the row says whether the second reproduced the first, and its TTFTs."""
    from tests.integrations.vllm.engine_runner import outputs
    from tests.integrations.vllm.tiny_vllm_models import save_model  # needs transformers: imported on use

    settings = MODELS[model]
    length = settings["prompt"]
    work = directory / f"{model}-{backend}"
    work.mkdir(parents=True)
    job: dict[str, Any] = {"model": str(save_model(model, work / "model")), "dtype": settings["dtype"],
                           "attention_backend": backend, "max_num_batched_tokens": 2048}
    if "mamba_ssm_cache_dtype" in settings:
        job["mamba_ssm_cache_dtype"] = settings["mamba_ssm_cache_dtype"]
    x, y, z = _prompt(1, length), _prompt(2, length), _prompt(3, length)
    name = f"vLLM {model} on {backend}"
    # Without "chunk" the chunk follows the block sizes vLLM picks (a hybrid's, one step of its grid of states).
    connector = {"store": f"file://{work}/kv", **({"chunk_size": settings["chunk"]} if "chunk" in settings else {})}
    try:
        first = _run({**job, "connector": connector, "prefix_caching": True, "phases": [
            {"requests": _prompt(0, 32), "max_tokens": 1, "kv_transfer_params": OFF},  # warm-up
            {"requests": x}, {"requests": y, "max_tokens": 1},
        ]}, work, "first")
        second = _run({**job, "connector": connector, "prefix_caching": True, "phases": [
            {"requests": _prompt(0, 32), "max_tokens": 1, "kv_transfer_params": OFF},
            {"requests": x}, {"requests": y, "max_tokens": 1}, {"requests": y, "max_tokens": 1},
            {"requests": z, "max_tokens": 1, "kv_transfer_params": OFF},
        ]}, work, "second")
    except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as error:
        return name, "reuse from a second process", f"NO: {error}"
    chunk = settings.get("chunk") or first[0]["block_size"]
    expected = (length - 1) // chunk * chunk  # whole chunks, never the last prompt token
    cached = second[1]["outputs"][0]["num_cached_tokens"]
    same = outputs(second[1]) == outputs(first[1])
    milliseconds = [phase["seconds"] * 1000 for phase in second[2:5]]
    verdict = "same tokens and logprobs" if same and cached == expected else (
        f"NO: {'tokens or logprobs DIFFER' if not same else 'same output'}, {cached} of {expected} tokens cached")
    return (name, f"reuse from a 2nd process, chunk {chunk}; TTFT of {length} tokens",
            f"{verdict}; store hit {milliseconds[0]:.1f} ms, vLLM prefix cache {milliseconds[1]:.1f} ms, "
            f"computed {milliseconds[2]:.1f} ms")


def engine_rows(backends: tuple[str, ...], models: tuple[str, ...] = tuple(MODELS)) -> list[Row]:
    with tempfile.TemporaryDirectory() as directory:
        return [engine_row(model, backend, Path(directory)) for model in models for backend in backends]
