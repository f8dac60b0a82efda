"""Disaggregated prefill through the store with two ``vllm serve`` (issue 41), driven as a router drives them:
the prompt to the prefill server (``kv_producer``) with ``max_tokens`` 1 and ``{"do_remote_decode": true}``,
the ``kv_transfer_params`` of its response, with the same prompt, to the decode server (``kv_consumer``) the
moment the response arrives. Both on one file store; no address of the prefill server is given."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.test_serve import MODEL_NAME, kvgroups_lines, served, value, wait_until
from tests.support.paths import ROOT
from tests.support.ports import serve_on_free_port, stop_process_group

PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
WAIT_SECONDS = 3.0  # the decode server's wait where entries are gone
# Where they land: both servers and their engines share this machine's two cores, and a save lands late.
LANDING_WAIT_SECONDS = 60.0


def tokens_of(seed: int, length: int) -> list[int]:
    return [4 + (index * 53 + seed * 97 + 5) % 500 for index in range(length)]


def command(role: str, kind: str, wait: float = LANDING_WAIT_SECONDS) -> Callable[[Path, int, str], list[str]]:
    """``vllm serve`` in ``role``: the llama-like model with a 64-token chunk and prefix caching off, or a
    hybrid under vLLM's defaults (prefix caching on, align mode, the chunk following vLLM's block size)."""
    def build(model: Path, port: int, store: str) -> list[str]:
        extra: dict[str, Any] = {"store": store, "handover_wait_seconds": wait}
        options = ["--dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32", "--kv-cache-memory-bytes",
                   str(256 << 20), "--max-model-len", "2048"]
        if kind == "llama":
            extra["chunk_size"] = 64
            options = ["--dtype", "float32", "--block-size", "32", "--no-enable-prefix-caching", "--max-model-len",
                       "1024"]
        connector = {"kv_connector": "KVGroupsConnector", "kv_connector_module_path": "kvgroups.integrations.vllm",
                     "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                "--max-num-seqs", "4", "--enable-prompt-tokens-details", *options,
                "--kv-transfer-config", json.dumps(connector)]
    return build


def complete(base: str, tokens: list[int], max_tokens: int = 8, **body: Any) -> dict[str, Any]:
    data = json.dumps({"model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                       **body}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return dict(json.loads(answer.read()))


@contextmanager
def routed(prefill: str, decode: str, log: Path) -> Iterator[str]:
    """kvgroups' P/D router (kvgroups.integrations.vllm.pd_proxy) in a process of its own."""
    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "kvgroups.integrations.vllm.pd_proxy", "--prefill", prefill, "--decode", decode,
                "--port", str(port)]

    router, port = serve_on_free_port(command, log, ready=lambda port: _answers(f"http://127.0.0.1:{port}/v1/models"),
                                      seconds=120, what="the P/D router",
                                      env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(router)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def stream(base: str, tokens: list[int], max_tokens: int = 8) -> str:
    """A streamed greedy completion's text."""
    data = json.dumps({"model": MODEL_NAME, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=120) as answer:
        for line in answer:
            if line.startswith(b"data: {"):
                text.append(json.loads(line[len(b"data: "):])["choices"][0]["text"])
    return "".join(text)


@pytest.mark.parametrize(("kind", "lengths"), [("llama", (530, 700, 1000)), ("qwen3_next", (900, 1500))])
def test_a_decode_server_loads_what_the_prefill_server_saved_and_answers_as_one_server(
        kind: str, lengths: tuple[int, ...], tmp_path: Path) -> None:
    """A prefill and a decode server on one store (``hand_overs_land``); for the llama-like model then a decode
    server waiting only WAIT_SECONDS, on the same prefill server and store
    (``gone_entries_are_computed_within_the_wait``: one prefill server for both, a server start less)."""
    from tests.integrations.vllm.tiny_vllm_models import save_model

    model = save_model(kind, tmp_path / kind)
    directory = tmp_path / "kv"
    store = f"file://{directory}"
    with served(model, store, tmp_path / "prefill.log", command("kv_producer", kind)) as prefill:
        with served(model, store, tmp_path / "decode.log", command("kv_consumer", kind)) as decode:
            hand_overs_land(kind, lengths, prefill, decode, tmp_path)
        if kind == "llama":
            with served(model, store, tmp_path / "waiting.log", command("kv_consumer", kind, WAIT_SECONDS)) as decode:
                gone_entries_are_computed_within_the_wait(prefill, decode, directory)


def hand_overs_land(kind: str, lengths: tuple[int, ...], prefill: str, decode: str, tmp_path: Path) -> None:
    """Each prompt to the prefill server, its hand-over to the decode server at once: the decode server loads
    every chunk handed over and answers as one server computing the whole prompt; then one request through
    kvgroups' router, streamed."""
    loaded = 0
    for seed, length in enumerate(lengths):
        tokens = tokens_of(seed, length)
        first = complete(prefill, tokens, max_tokens=1, kv_transfer_params=dict(PREFILL))
        params = first["kv_transfer_params"]
        handed = params["kvgroups_handover"]["tokens"]
        answer = complete(decode, tokens, kv_transfer_params=params)  # at once: saves may still be landing
        assert handed > 0 and handed % 64 == 0 and handed <= length - 1, params
        # vLLM reports a P/D request's cached tokens as the prefill server's own hits (its
        # remote_prefill_cached_tokens), so the decode server's counters say what it loaded.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        loaded += handed
        wait_until(lambda loaded=loaded: value(kvgroups_lines(decode), "vllm:kvgroups_handover_tokens_total")
                   == loaded,
                   f"the decode server loading {handed} tokens of a {length}-token prompt")
        # What one server computing the whole prompt answers (a producer never loads).
        whole = complete(prefill, tokens)
        assert answer["choices"][0]["text"] == whole["choices"][0]["text"]
    # The same through kvgroups' own router, streamed: one request, as a client sends it.
    tokens = tokens_of(len(lengths), lengths[0])
    with routed(prefill, decode, tmp_path / "router.log") as proxy:
        streamed = stream(proxy, tokens)
    loaded += (lengths[0] - 1) // 64 * 64 if kind == "llama" else 0
    wait_until(lambda: value(kvgroups_lines(decode), "vllm:kvgroups_handovers_received_total") == len(lengths) + 1,
               "the routed request's hand-over")
    assert streamed == complete(prefill, tokens)["choices"][0]["text"]
    lines = kvgroups_lines(decode)
    if kind != "llama":  # the hybrid's whole chunks follow vLLM's block size: some were handed over
        before, loaded = loaded, int(value(lines, "vllm:kvgroups_handover_tokens_total"))
        assert loaded > before
    assert value(lines, "vllm:kvgroups_loaded_tokens_total") == loaded
    assert value(lines, "vllm:kvgroups_handovers_received_total") == len(lengths) + 1
    assert value(lines, "vllm:kvgroups_handover_tokens_total") == loaded
    assert value(lines, "vllm:kvgroups_handover_waits_expired_total") == 0
    assert value(kvgroups_lines(prefill), "vllm:kvgroups_handovers_sent_total") == len(lengths) + 1


def gone_entries_are_computed_within_the_wait(prefill: str, decode: str, directory: Path) -> None:
    """A hand-over whose entries are saved, then deleted before the decode server (waiting WAIT_SECONDS) reads
    them: computed once its wait runs out, answering as the prefill server computing it all."""
    import time

    tokens = tokens_of(7, 800)
    params = complete(prefill, tokens, max_tokens=1, kv_transfer_params=dict(PREFILL))["kv_transfer_params"]
    time.sleep(1)  # the saves landed...
    for entry in [path for path in directory.rglob("*") if path.is_file() and path.parent != directory]:
        entry.unlink()  # ...and are gone before the decode server reads them
    started = time.monotonic()
    answer = complete(decode, tokens, kv_transfer_params=params)
    waited = time.monotonic() - started
    whole = complete(prefill, tokens)
    lines = kvgroups_lines(decode)
    assert answer["choices"][0]["text"] == whole["choices"][0]["text"]
    assert WAIT_SECONDS <= waited < WAIT_SECONDS + 30
    assert value(lines, "vllm:kvgroups_handover_waits_expired_total") == 1
    assert value(lines, "vllm:kvgroups_handover_tokens_total") == 0
    assert value(lines, "vllm:kvgroups_loaded_tokens_total") == 0


def test_the_documented_command_lines_are_the_tested_ones() -> None:
    """docs/vllm.md's two `vllm serve` lines: the connector settings these tests serve with, roles in order
    (the store, chunk size and wait are each deployment's own)."""
    import re
    import shlex

    text = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    marker = ("<!-- tested: tests/integrations/vllm/test_pd_serve.py::"
              "test_the_documented_command_lines_are_the_tested_ones -->")
    block = text.split(marker, 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.startswith("vllm serve")]
    assert len(lines) == 2
    for line, role in zip(lines, ("kv_producer", "kv_consumer"), strict=True):
        words = shlex.split(line)
        shown = json.loads(words[words.index("--kv-transfer-config") + 1])
        tested_words = command(role, "llama")(Path("MODEL"), 8100, "redis://kv-cluster:6379/0")
        tested = json.loads(tested_words[tested_words.index("--kv-transfer-config") + 1])
        for settings in (shown, tested):
            settings["kv_connector_extra_config"] = {key: value for key, value in
                                                     settings["kv_connector_extra_config"].items()
                                                     if key not in ("chunk_size", "handover_wait_seconds")}
        assert shown == tested, line
        assert re.fullmatch(r"vllm serve MODEL --port \d+ --kv-transfer-config '.*'", line)
