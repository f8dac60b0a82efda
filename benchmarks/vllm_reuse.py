"""Time to first token in vLLM with KVGroupsConnector serving a stored prefix, against computing it.

A random-weight llama-like model (8 layers, hidden 1024, 16 heads, 8 KV heads, vocab 32000,
float32: the model of benchmarks/reuse.py) served by vLLM's CPU engine, and a 4096-token prompt
of which 3840 tokens (15 chunks of 256) are in a file store. One engine with the connector,
interleaved (computed, reused, computed, ...): "computed" turns the connector off for the request
(``kv_transfer_params={"kvgroups": {"load": False, "save": False}}``), "reused" loads the prefix.
TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1``. A second engine without any
connector, in its own process, measures the plain engine for reference (vLLM runs one engine per
process once the connector's numba kernels are loaded).

Run with the vLLM environment: ``.venv-vllm/bin/python benchmarks/vllm_reuse.py``.
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
from pathlib import Path
from typing import Any

PROMPT, CHUNK = 4096, 256
OFF = {"kvgroups": {"load": False, "save": False}}


def save_model(directory: Path) -> None:
    from models import save_llama_like

    save_llama_like(directory)


def engine_run(model: str, store: str | None, rounds: int, out: str) -> None:
    """In a fresh process: one engine (with the connector when ``store``), its timings as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {}
    if store is not None:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"store": store, "chunk_size": CHUNK},
            kv_load_failure_policy="recompute")
    engine = LLM(model=model, dtype="float32", block_size=128, enforce_eager=True, enable_prefix_caching=False,
                 max_model_len=PROMPT + 64, max_num_batched_tokens=PROMPT + 64, max_num_seqs=1, seed=0,
                 skip_tokenizer_init=True, **extra)
    prompt = [(index * 7919 + 13) % 32000 for index in range(PROMPT)]

    def ttft(kv_transfer_params: dict[str, Any] | None) -> tuple[float, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1,
                                extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
        started = time.perf_counter()
        (output,) = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        token = output.outputs[0].token_ids[0]
        return seconds, (token, output.outputs[0].logprobs[0][token].logprob, output.num_cached_tokens)

    results: dict[str, Any] = {"computed": [], "reused": [], "answers": []}
    if store is None:
        ttft(None)  # warm-up
        for _ in range(rounds):
            seconds, answer = ttft(None)
            results["computed"].append(seconds)
            results["answers"].append(answer)
    else:
        ttft(None)  # computes the prompt and saves its full chunks
        from kvgroups.integrations.vllm import flush_saves

        engine.collective_rpc(flush_saves)
        ttft(OFF)  # warm-up of the computed path
        for _ in range(rounds):
            for name, params in (("computed", OFF), ("reused", None)):
                seconds, answer = ttft(params)
                results[name].append(seconds)
                results["answers"].append([name, *answer])
    Path(out).write_text(json.dumps(results))


def spawn(model: str, store: str | None, rounds: int, directory: Path, name: str) -> dict[str, Any]:
    out = directory / f"{name}.json"
    command = [sys.executable, __file__, "--engine", "--model", model, "--rounds", str(rounds), "--out", str(out)]
    if store is not None:
        command += ["--store", store]
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    subprocess.run(command, check=True, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_run(args.model, args.store, args.rounds, args.out)
        return
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory(prefix="kvgroups-vllm-bench-") as temporary:
        directory = Path(temporary)
        model = directory / "llama"
        save_model(model)
        connector = spawn(str(model), f"file://{directory}/kv", args.rounds, directory, "connector")
        plain = spawn(str(model), None, args.rounds, directory, "plain")
    computed, reused = connector["computed"], connector["reused"]
    ratios = [a / b for a, b in zip(computed, reused, strict=True)]
    # Per variant: the set of (first token, its logprob) over every run, against the plain engine's.
    answers: dict[str, set[tuple[int, float]]] = {"computed": set(), "reused": set()}
    for name, token, logprob, _ in connector["answers"]:
        answers[name].add((token, logprob))
    answers["plain"] = {(token, logprob) for token, logprob, _ in plain["answers"]}
    (reference_token, reference_logprob), *more = sorted(answers["plain"])
    cached = sorted({answer[3] for answer in connector["answers"] if answer[0] == "reused"})
    table = Table(title=f"vLLM CPU, {PROMPT}-token prompt, {cached} tokens from a file store (chunks of {CHUNK}); "
                        f"medians of {args.rounds} interleaved rounds")
    for column in ("engine", "TTFT s", "speed-up vs computed", "first token", "max |Δ logprob| vs no connector"):
        table.add_column(column, justify="right" if column != "engine" else "left")

    def answer_cells(name: str) -> tuple[str, str]:
        tokens = sorted({token for token, _ in answers[name]})
        delta = max(abs(logprob - reference_logprob) for _, logprob in answers[name])
        return ("same" if tokens == [reference_token] else f"differs: {tokens}"), f"{delta:.1e}"

    table.add_row("connector, prefix computed (request opts out)", f"{statistics.median(computed):.3f}", "1.00x",
                  *answer_cells("computed"))
    table.add_row("connector, prefix reused", f"{statistics.median(reused):.3f}",
                  f"{statistics.median(ratios):.1f}x (paired)", *answer_cells("reused"))
    table.add_row("no connector (its own process)", f"{statistics.median(plain['computed']):.3f}",
                  f"{statistics.median(computed) / statistics.median(plain['computed']):.2f}x (not paired)",
                  f"token {reference_token}", "0" if not more else f"runs differ: {sorted(answers['plain'])}")
    Console(width=160).print(table)

if __name__ == "__main__":
    main()
