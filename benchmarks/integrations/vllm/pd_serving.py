"""Disaggregated prefill through the store against one server doing both, with ``vllm serve`` (CPU build).

Multi-user conversations as in ``serving``: ``--users`` users share a system prompt, each has
a context of their own, and each round a user asks a question (appended to their history) and
streams an answer of ``--answer`` tokens (appended too); a user's next question waits for their
answer, the users run concurrently. Two arms, each on both of this machine's cores, each on a file
store of its own (the model's ``benchmarks.support.models`` version: llama-like, or the qwen3-next-like
hybrid under vLLM's defaults):

* ``one server``: one ``vllm serve`` (``kv_both``, both CPUs) prefills and decodes every request.
* ``P/D``: a prefill server (``kv_both``: it saves every prompt and loads the history its earlier
  rounds saved; CPU 0) answers each prompt with ``max_tokens`` 1 and ``{"do_remote_decode": true}``,
  then the decode server (``kv_consumer``; CPU 1) streams the answer from the same prompt with the
  response's ``kv_transfer_params``, as a router sends them.

Reported per arm: TTFT (for P/D the prefill's response plus the decode server's first token, what a
user waits), time between tokens of the streamed answers, wall time, tokens handed over (the decode
server's ``kvgroups_handover_tokens_total``), waits that ran out, and how many answers equal the
one server's. Both arms share two cores: P/D gives each server one, so a prefill never slows a
decode step of the other server, and each server has half the machine.

Run in the vLLM environment: ``.venv-vllm/bin/python -m benchmarks.integrations.vllm.pd_serving
[--model qwen3-next-like]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.support import models
from benchmarks.support.vllm_serve import VllmServer
from kvgroups.integrations.vllm.pd_proxy import prefill_body

# Per model: how it is saved and its engine's options (the hybrid under vLLM's defaults: prefix cache on).
MODELS: dict[str, dict[str, Any]] = {
    "llama-like": {"save": models.save_llama_like, "chunk": 256, "exact": True,
                   "options": ["--dtype", "float32", "--block-size", "128", "--no-enable-prefix-caching"]},
    "qwen3-next-like": {"save": models.save_qwen3_next_like, "chunk": None, "exact": False,
                        "options": ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32"]},
}
class RoleServer(VllmServer):
    """A ``vllm serve`` of one P/D role, on CPUs of its own."""

    def __init__(self, name: str, model: Path, store: str, directory: Path, cpus: list[int], role: str,
                 settings: dict[str, Any]) -> None:
        super().__init__(name, model, [store], directory, kv_bytes=256 << 20, cpus=cpus)
        self.role, self.settings = role, settings

    def command(self, port: int) -> list[str]:
        extra: dict[str, Any] = {"store": self.store[0]}
        if self.settings["chunk"]:
            extra["chunk_size"] = self.settings["chunk"]
        connector = {"kv_connector": "KVGroupsConnector", "kv_connector_module_path": "kvgroups.integrations.vllm",
                     "kv_role": self.role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                "--skip-tokenizer-init", "--max-model-len", "4096", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "4096",
                "--kv-cache-memory-bytes", str(self.kv_bytes), *self.settings["options"],
                "--kv-transfer-config", json.dumps(connector)]


def post(base: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(f"{base}/v1/completions", data=json.dumps({"model": "model", **body}).encode(),
                                  headers={"Content-Type": "application/json"})


def stream(base: str, prompt: list[int], max_tokens: int, **extra: Any) -> tuple[list[float], list[int]]:
    """Stream a greedy answer: the arrival time of each token's event and the answer's tokens (no tokenizer:
    the benchmark's models have none)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **extra}
    arrivals: list[float] = []
    answer_tokens: list[int] = []
    with urllib.request.urlopen(post(base, body), timeout=600) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event.get("choices"):
                arrivals.append(time.monotonic())
                answer_tokens += event["choices"][0].get("token_ids") or []
    return arrivals, answer_tokens


def complete(base: str, prompt: list[int], max_tokens: int, **extra: Any) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    with urllib.request.urlopen(post(base, body), timeout=600) as answer:
        return [int(token) for token in json.loads(answer.read())["choices"][0]["token_ids"]]


def prefill(base: str, prompt: list[int]) -> dict[str, Any]:
    """The prefill server's hand-over for ``prompt``, asked as kvgroups' router asks it."""
    with urllib.request.urlopen(post(base, prefill_body({"prompt": prompt, "temperature": 0})),
                                timeout=600) as answer:
        params: dict[str, Any] = json.loads(answer.read())["kv_transfer_params"]
    return params


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500, 31000) for _ in range(count)]


def converse(arm: str, servers: dict[str, RoleServer], arguments: argparse.Namespace) -> dict[str, Any]:
    """Every user's rounds on one arm; per request (TTFT, gaps between tokens, answer text)."""
    system = tokens(1, arguments.system)
    results: list[tuple[int, int, float, list[float], list[int], list[int]]] = []
    lock = threading.Lock()

    def user(index: int) -> None:
        history = system + tokens(100 + index, arguments.context)
        for round_ in range(arguments.rounds):
            history = history + tokens(10_000 + index * 100 + round_, arguments.question)
            started = time.monotonic()
            if arm == "P/D":
                params = prefill(servers["prefill"].base, history)
                arrivals, text = stream(servers["decode"].base, history, arguments.answer, kv_transfer_params=params)
            else:
                arrivals, text = stream(servers["both"].base, history, arguments.answer)
            gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
            with lock:
                results.append((index, round_, arrivals[0] - started, gaps, text, history))
            history = history + text

    began = time.monotonic()
    threads = [threading.Thread(target=user, args=(index,)) for index in range(arguments.users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - began
    # The answer each prompt gets computed from nothing on the server that answered it (the decode server
    # for P/D): loads and saves off, a cache salt of its own. Its numerics are that server's (its threads,
    # dtype), so this, not the other arm, is what a reused answer must equal.
    computing = servers["decode" if arm == "P/D" else "both"].base
    recomputed = sum(
        complete(computing, prompt, arguments.answer, cache_salt=f"reference-{user}-{round_}",
                 kv_transfer_params={"kvgroups": {"load": False, "save": False}}) == text
        for user, round_, _, _, text, prompt in results)
    ttft = [result[2] for result in results]
    gaps = [gap for result in results for gap in result[3]]
    return {"wall_s": wall, "recomputed_equal": recomputed, "ttft_p50": statistics.median(ttft),
            "ttft_p90": sorted(ttft)[int(0.9 * (len(ttft) - 1))], "tbt_p50": statistics.median(gaps),
            "tbt_p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))], "requests": len(results),
            "answers": {(user, round_): text for user, round_, _, _, text, _ in results}}


def run_arm(arm: str, model: Path, directory: Path, arguments: argparse.Namespace) -> dict[str, Any]:
    settings = MODELS[arguments.model]
    store = f"file://{directory / arm.replace('/', '')}-kv"
    if arm == "P/D":
        servers = {"prefill": RoleServer("prefill", model, store, directory, [0], "kv_both", settings),
                   "decode": RoleServer("decode", model, store, directory, [1], "kv_consumer", settings)}
    else:
        servers = {"both": RoleServer("both", model, store, directory, [0, 1], "kv_both", settings)}
    try:
        for server in servers.values():
            server.start()
        result = converse(arm, servers, arguments)
        counters = servers["decode"].metrics() if arm == "P/D" else {}
        result["handed_over"] = sum(value for name, value in counters.items()
                                    if name.startswith("vllm:kvgroups_handover_tokens_total"))
        result["waits_expired"] = sum(value for name, value in counters.items()
                                      if name.startswith("vllm:kvgroups_handover_waits_expired_total"))
        return result
    finally:
        for server in servers.values():
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-like")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    parser.add_argument("--context", type=int, default=256, help="tokens of each user's own context")
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--keep", help="a directory to keep the servers' logs in (default: a temporary one)")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgroups-pd-") as temporary:
        directory = Path(arguments.keep or temporary)
        directory.mkdir(parents=True, exist_ok=True)
        model = directory / "model"
        MODELS[arguments.model]["save"](model)
        results = {arm: run_arm(arm, model, directory, arguments) for arm in ("one server", "P/D")}
    same = sum(results["P/D"]["answers"][key] == text for key, text in results["one server"]["answers"].items())
    print(f"{arguments.model}: {arguments.users} users x {arguments.rounds} rounds, system {arguments.system} + "
          f"context {arguments.context} + {arguments.question} a question, answers of {arguments.answer} tokens")
    print("| arm | TTFT p50 ms | TTFT p90 ms | between tokens p50 ms | p90 ms | wall s | handed over | waits run out "
          "| answers = recomputed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm, result in results.items():
        handed = f"{result['handed_over']:.0f}" if arm == "P/D" else "-"
        expired = f"{result['waits_expired']:.0f}" if arm == "P/D" else "-"
        print(f"| {arm} | {1e3 * result['ttft_p50']:.0f} | {1e3 * result['ttft_p90']:.0f} | "
              f"{1e3 * result['tbt_p50']:.1f} | {1e3 * result['tbt_p90']:.1f} | {result['wall_s']:.1f} | {handed} | "
              f"{expired} | {result['recomputed_equal']} of {result['requests']} |")
    # Informational: the arms run on different thread counts (one server both CPUs, each P/D server one), and
    # a bfloat16 model's greedy answers may part where its two best tokens are near-tied.
    print(f"P/D answers equal to one server's: {same} of {len(results['one server']['answers'])}")
    # float32 answers are the same whatever the batch; bfloat16 ones part where a batch of other users' requests
    # (or vLLM's own prefix cache) rounds differently from the recomputation, alone, on either arm.
    if MODELS[arguments.model]["exact"] and any(result["recomputed_equal"] != result["requests"]
                                                for result in results.values()):
        sys.exit("an answer differs from its server's own recomputation")


if __name__ == "__main__":
    main()
