"""Conversations with long replies on vLLM's CPU engine: decode saves on (the default) against off.

``--users`` users each hold a conversation of ``--turns`` turns, concurrently: a first prompt of
``--prompt-tokens`` tokens, then each turn the user's history (every prompt and reply so far) and a
message of ``--message-tokens``; a reply is ``--reply-tokens MIN MAX`` tokens long (a fixed spread
over users and turns, the same in every run), and a user's next turn waits for their reply. Nothing
of a history stays in vLLM between turns for the llama-like model (its prefix cache off, as when the
next turn lands on another server or the history was evicted), so what a turn reuses comes from the
store; the qwen3-next-like hybrid runs under vLLM's defaults (its prefix cache on, states on vLLM's
grid, the chunk following it). With ``save_decode`` off, a reply's tokens are saved only as part of
the next turn's prompt, after that turn computed them.

Each run is one engine with the connector on a fresh file store, in a process of its own; the two
variants alternate run by run (on, off, off, on, ...). Per run: the next turns' TTFT (turns after
the first: the time from a request's submission to its first token, p50), the tokens they loaded
from the store against their prompts' tokens, the time between tokens while decoding (per request:
from its first token to its last over the tokens in between, p50), the store's bytes at the end,
the chunks saved while decoding and the wall time. Reported: medians over runs, and the medians of
the paired ratios on/off (run i of one variant against run i of the other).

Run with the vLLM environment: ``.venv-vllm/bin/python -m benchmarks.integrations.vllm.conversations
[--model qwen3-next-like]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.integrations.vllm.serving import MODELS, percentile, spawn, tokens

VARIANTS = ("save_decode on", "save_decode off")


def reply_length(user: int, turn: int, low: int, high: int) -> int:
    """A spread of reply lengths over users and turns, from ``low`` to ``high``, the same in every run."""
    return low + (user * 7 + turn * 3) % 8 * (high - low) // 7


def engine_run(job: dict[str, Any]) -> None:
    """In a fresh process: one engine with the connector, the conversations, as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvgroups.integrations.vllm import flush_saves
    from kvgroups.store import FileStore

    chunk = {"chunk_size": job["chunk"]} if job["chunk"] else {}
    llm = LLM(model=job["model"], enforce_eager=True, **job["engine"], enable_prefix_caching=job["prefix_caching"],
              kv_cache_memory_bytes=job["kv_mib"] << 20, max_model_len=job["max_model_len"],
              max_num_batched_tokens=4096, max_num_seqs=16, seed=0, skip_tokenizer_init=True,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
                  kv_role="kv_both",
                  kv_connector_extra_config={"store": job["store"], "save_decode": job["save_decode"], **chunk},
                  kv_load_failure_policy="recompute"))
    engine = llm.llm_engine
    users, turns = job["users"], job["turns"]
    histories = [tokens(job["seed"] * 1000 + user, job["prompt_tokens"]) for user in range(users)]
    turn_of = [0] * users
    submitted: dict[str, tuple[int, int, float]] = {}
    first: dict[str, float] = {}
    results: list[dict[str, Any]] = []

    def ask(user: int) -> None:
        turn = turn_of[user]
        if turn:
            histories[user] += tokens(job["seed"] * 1000 + 100 * user + turn + 50, job["message_tokens"])
        request_id = f"u{user}t{turn}"
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=reply_length(user, turn, *job["reply_tokens"]))
        engine.add_request(request_id, {"prompt_token_ids": list(histories[user])}, params)
        submitted[request_id] = (user, turn, time.perf_counter())

    started = time.perf_counter()
    for user in range(users):
        ask(user)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            user, turn, asked = submitted[output.request_id]
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = now
            if output.finished:
                reply = list(output.outputs[0].token_ids)
                results.append({"turn": turn, "ttft": first[output.request_id] - asked,
                                "between_tokens": (now - first[output.request_id]) / max(1, len(reply) - 1),
                                "prompt_tokens": len(histories[user]), "loaded": output.num_cached_tokens or 0})
                histories[user] += reply
                turn_of[user] += 1
                if turn_of[user] < turns:
                    ask(user)
    seconds = time.perf_counter() - started
    llm.collective_rpc(flush_saves)
    side = engine.engine_core.engine_core.scheduler.connector._scheduler
    Path(job["out"]).write_text(json.dumps({
        "seconds": seconds, "requests": results, "decode_saves": side.counts.decode_saves,
        "store_bytes": FileStore(job["store"].removeprefix("file://"), create=False).stats().bytes}))


def summary(run: dict[str, Any]) -> dict[str, float]:
    later = [request for request in run["requests"] if request["turn"]]
    return {
        "next-turn TTFT p50 s": percentile([request["ttft"] for request in later], 0.5),
        "next-turn tokens loaded / prompt": sum(request["loaded"] for request in later)
        / sum(request["prompt_tokens"] for request in later),
        "time between tokens p50 ms": 1e3 * percentile([request["between_tokens"] for request in run["requests"]],
                                                       0.5),
        "store MiB": run["store_bytes"] / 2**20, "chunks saved while decoding": run["decode_saves"],
        "wall s": run["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama-like")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--message-tokens", type=int, default=128)
    parser.add_argument("--reply-tokens", type=int, nargs=2, default=(512, 2048), metavar=("MIN", "MAX"))
    parser.add_argument("--kv-mib", type=int, default=2048, help="vLLM's own KV space (MiB)")
    parser.add_argument("--runs", type=int, default=2, help="runs per variant, alternating")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_run(json.loads(Path(args.engine).read_text()))
        return
    from benchmarks.support import models

    model = MODELS[args.model]
    longest = args.prompt_tokens + (args.turns - 1) * args.message_tokens + args.turns * args.reply_tokens[1]
    job = {key: getattr(args, key) for key in ("users", "turns", "prompt_tokens", "message_tokens", "reply_tokens",
                                                "kv_mib")}
    job.update(engine=model["engine"], chunk=model["chunk"], prefix_caching=model["prefix_caching"],
               max_model_len=longest + 64, seed=7)
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="kvgroups-conversations-") as temporary:
        directory = Path(temporary)
        getattr(models, model["save"])(directory / "model")
        config = json.loads((directory / "model" / "config.json").read_text())
        (directory / "model" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16384}))
        job["model"] = str(directory / "model")
        for index in range(args.runs):
            order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                name = f"{variant.replace(' ', '-')}-{index}"
                result = spawn({**job, "save_decode": variant.endswith("on"),
                                "store": f"file://{directory}/{name}"}, directory, name,
                               module="benchmarks.integrations.vllm.conversations")
                if "error" in result:
                    raise SystemExit(f"{variant}: {result['error']}")
                runs[variant].append(summary(result))
    columns = list(runs[VARIANTS[0]][0])
    print(f"{args.model}: {args.users} users x {args.turns} turns, first prompt {args.prompt_tokens} tokens, messages "
          f"{args.message_tokens}, replies {args.reply_tokens[0]}-{args.reply_tokens[1]} tokens; vLLM's prefix cache "
          f"{'on' if model['prefix_caching'] else 'off'}; medians over {args.runs} runs per variant\n")
    print("| variant | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for variant in VARIANTS:
        print(f"| {variant} | " + " | ".join(f"{statistics.median(run[column] for run in runs[variant]):.3g}"
                                             for column in columns) + " |")
    ratios = [f"{statistics.median(on[column] / off[column] for on, off in zip(*runs.values(), strict=True)):.3g}"
              if all(run[column] for run in runs[VARIANTS[1]]) else "-" for column in columns]
    print("| on / off (median of paired ratios) | " + " | ".join(ratios) + " |")
    print("\npaired ratios on / off, run by run: " + "; ".join(
        ", ".join(f"{column} {on[column] / off[column]:.3g}" for column in columns if off[column])
        for on, off in zip(*runs.values(), strict=True)))


if __name__ == "__main__":
    main()
