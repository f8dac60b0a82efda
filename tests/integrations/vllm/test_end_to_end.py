"""vLLM engines with the connector, each in a fresh process: the second reuses what the first stored.

Tiny random-weight models saved here; greedy with logprobs; vLLM's own prefix cache off, so every
cached token is the connector's. Outputs are compared with a run without the connector (for the
multiprocess test, with its first engine's misses) in the same execution mode (vLLM's in-process
and multiprocess engines differ in float rounding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgroups.core.dtypes import dtype_from_name
from kvgroups.store import FileStore, open_store
from kvgroups.store.entries.codec import EntryInfo, decode_entry, encode_entry, read_header
from tests.integrations.vllm.engine_runner import outputs, run_job
from tests.integrations.vllm.tiny_vllm_models import save_model
from tests.support.servers import running_server

CHUNK = 64
PROMPT_TOKENS = 300  # 4 full chunks; a hit covers 256 (never the last prompt token)


def prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    return [4 + (index * 37 + seed * 101 + 11) % 508 for index in range(length)]


def run_engines(job: dict[str, Any], tmp_path: Path, name: str, *, multiprocess: bool,
                forked: bool = True) -> list[dict[str, Any]]:
    """Run the job's phases in a process of its own (forked from the engine zygote, or with ``forked=False`` a
    fresh interpreter); each phase's outputs (and the store's keys after it)."""
    return run_job(job, tmp_path, name, multiprocess=multiprocess, forked=forked)


def cached(phase: dict[str, Any]) -> list[int]:
    return [output["num_cached_tokens"] for output in phase["outputs"]]


def requests(*token_lists: list[int], cache_salt: str | None = None) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": tokens, **({"cache_salt": cache_salt} if cache_salt else {})}
            for tokens in token_lists]


def add_noise(store_dir: Path, key: str) -> None:
    """Replace an entry by a valid one (checksum and all) holding other KV: a load that uses it must differ."""
    store = FileStore(store_dir)
    value = store.get(key)
    assert value is not None
    fields = read_header(value)["__metadata__"]
    info = EntryInfo(key=fields["key"], fingerprint=fields["fingerprint"], group_index=int(fields["group"]),
                     chunk_index=int(fields["chunk"]), dtype=dtype_from_name(fields["dtype"]),
                     shape=tuple(json.loads(fields["shape"])))
    tensor = decode_entry(value, info)
    store.put(key, encode_entry(tensor + torch.randn(tensor.shape).to(tensor.dtype), info))


def flip_a_byte(store_dir: Path, key: str) -> None:
    path = Path(FileStore(store_dir)._path(key))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def flip_a_stored_byte(url: str, key: str) -> None:
    with open_store(url) as store:
        value = bytearray(store.get(key) or b"")
        assert value
        value[len(value) // 2] ^= 0x01
        store.put(key, bytes(value))


def test_llama_reuses_a_file_store_across_processes_and_refuses_what_it_must(tmp_path: Path) -> None:
    """In-process engines, the second loading synchronously (a one-group model): vLLM's block-level
    load errors. Asynchronous loads and their per-request failures are the gemma3 and qwen3-next
    tests'; another connector salt never hitting is ``test_other_salts_never_hit`` (vLLM's scheduler).

    The engine without the connector runs in a fresh interpreter, the others forked from the engine zygote:
    their equal tokens and logprobs also hold the zygote to changing nothing of what an engine computes."""
    model = str(save_model("llama", tmp_path / "llama"))
    store_dir = tmp_path / "kv"
    connector = {"store": f"file://{store_dir}", "chunk_size": CHUNK, "salt": "deployment-a"}
    x, y, z = prompt(0), prompt(1), prompt(2)
    job = {"model": model, "store_dir": str(store_dir)}
    baseline = run_engines({**job, "connector": None, "phases": [
        {"requests": requests(x)}, {"requests": requests(y)}, {"requests": requests(z)},
    ]}, tmp_path, "baseline", multiprocess=False, forked=False)
    expected = {"x": outputs(baseline[0]), "y": outputs(baseline[1]), "z": outputs(baseline[2])}
    first = run_engines({**job, "connector": connector, "phases": [
        {"requests": requests(x)},
        {"requests": requests(y[:CHUNK + 1])},  # stores y's first chunk only
        {"requests": requests(y)},  # a hit of that chunk
        {"requests": requests(z)},
    ]}, tmp_path, "first", multiprocess=False)
    assert cached(first[0]) == [0] and outputs(first[0]) == expected["x"]  # storing changes nothing
    assert cached(first[2]) == [CHUNK] and outputs(first[2]) == expected["y"]
    keys_after = [set(phase["store_keys"]) for phase in first]
    assert len(keys_after[0]) == 4  # x's 4 full chunks, one group
    (y_first_chunk,) = keys_after[1] - keys_after[0]
    assert len(keys_after[2] - keys_after[1]) == 3  # y's other full chunks
    flip_a_byte(store_dir, y_first_chunk)
    for key in keys_after[3] - keys_after[2]:
        add_noise(store_dir, key)

    second = run_engines({**job, "connector": {**connector, "load_mode": "sync"}, "phases": [
        {"requests": requests(x)},
        {"requests": requests(y)},
        {"requests": requests(x, cache_salt="another-user")},
        {"requests": requests(z)},
    ]}, tmp_path, "second", multiprocess=False)
    assert cached(second[0]) == [256] and outputs(second[0]) == expected["x"]  # tokens and logprobs, exactly
    # A flipped byte: the lookup promised the hit (entries exist), the worker's load found the entry
    # corrupt and reported its blocks, vLLM recomputed them (it still counts them as cached: it sets
    # that at admission), with the same output.
    assert cached(second[1]) == [256] and outputs(second[1]) == expected["y"]
    assert y_first_chunk in second[1]["store_keys"]  # the recompute saved it again
    assert cached(second[2]) == [0] and outputs(second[2]) == expected["x"]  # another cache salt
    assert cached(second[3]) == [256] and outputs(second[3]) != expected["z"]  # the loaded KV is what is used


def test_gemma3_sliding_and_full_groups_reuse_redis_in_multiprocess_engines(tmp_path: Path) -> None:
    """Two vLLM KV-cache groups: loads are asynchronous, and a load that fails (an entry damaged after the
    lookup could see it) is reported per request, which vLLM recomputes.

    The first engine's requests all miss (an empty store), so its outputs are the baseline: a miss
    leaving the output as without the connector is the llama and qwen3-next tests' (in-process)."""
    model = str(save_model("gemma3", tmp_path / "gemma3"))
    x, y, w = prompt(3), prompt(4), prompt(6)
    with running_server(tmp_path) as server:
        connector = {"store": server.url, "chunk_size": CHUNK}
        first = run_engines({"model": model, "connector": connector, "store_url": server.url, "phases": [
            {"requests": requests(x)}, {"requests": requests(y)}, {"requests": requests(w)},
        ]}, tmp_path, "first", multiprocess=True)
        assert cached(first[0]) == cached(first[1]) == cached(first[2]) == [0]
        w_keys = sorted(set(first[2]["store_keys"]) - set(first[1]["store_keys"]))
        assert len(w_keys) == 8  # 4 chunks x 2 groups
        for key in w_keys:
            flip_a_stored_byte(server.url, key)
        second = run_engines({"model": model, "connector": connector, "phases": [
            {"requests": requests(x)},
            {"requests": requests(w)},
            # The server dies mid-run: the engine goes on, with misses.
            {"requests": requests(y), "before": {"stop_pid": server.process.pid}},
        ]}, tmp_path, "second", multiprocess=True)
    assert cached(second[0]) == [256] and outputs(second[0]) == outputs(first[0])
    assert cached(second[1]) == [0] and outputs(second[1]) == outputs(first[2])  # recomputed
    assert cached(second[2]) == [0] and outputs(second[2]) == outputs(first[1])


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="vLLM's amx attention kernels need a CPU with AMX tiles (grep amx_tile /proc/cpuinfo)")
def test_llama_in_bfloat16_reuses_a_prefix_on_vllms_amx_kernels(tmp_path: Path) -> None:
    """On a CPU with AMX, vLLM runs bfloat16 attention of block size 32 and head size 32 on its amx
    kernels, whose pages are tile-packed: a second engine's hit gives the tokens and logprobs of an
    engine without the connector."""
    model = str(save_model("llama", tmp_path / "llama"))
    store_dir = tmp_path / "kv"
    job = {"model": model, "dtype": "bfloat16", "store_dir": str(store_dir)}
    connector = {"store": f"file://{store_dir}", "chunk_size": CHUNK}
    phases = [{"requests": requests(prompt(0))}]
    baseline = run_engines({**job, "connector": None, "phases": phases}, tmp_path, "baseline", multiprocess=False)
    first = run_engines({**job, "connector": connector, "phases": phases}, tmp_path, "first", multiprocess=False)
    assert len(first[0]["store_keys"]) == 4 and outputs(first[0]) == outputs(baseline[0])
    second = run_engines({**job, "connector": connector, "phases": phases}, tmp_path, "second", multiprocess=False)
    assert cached(second[0]) == [256] and outputs(second[0]) == outputs(baseline[0])


def test_qwen3_next_restores_gated_deltanet_states_with_attention(tmp_path: Path) -> None:
    """A hybrid: linear-attention (gated DeltaNet) layers keep a state, full-attention layers K/V.

    vLLM runs this model in bfloat16 only, and sizes its attention blocks so that a page holds a
    state. Pinned so that every x86 CPU runs the same engine: SSM states in float32 (on auto vLLM
    keeps them in bfloat16 or resets them to float32, depending on the CPU's AVX512-BF16), and
    attention on vLLM's vec kernels (on CPUs with AMX it would pick its amx kernels: their pages are
    the llama amx test's). Blocks, and chunks, are then 288 tokens;
    prefill steps of one chunk end on chunk boundaries, where states are saved.
    """
    model = str(save_model("qwen3_next", tmp_path / "qwen3_next"))
    store_dir = tmp_path / "kv"
    job = {"model": model, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32", "cpu_attention_kernels": "vec",
           "max_num_batched_tokens": 288, "store_dir": str(store_dir),
           "connector": {"store": f"file://{store_dir}", "chunk_size": 288}}
    x, v, u = (prompt(seed, length=700) for seed in (5, 7, 8))  # a hit covers 576 tokens: two chunks
    phases = [{"requests": requests(x)}, {"requests": requests(v)}, {"requests": requests(u)}]
    baseline = run_engines({**job, "connector": None, "phases": phases}, tmp_path, "baseline", multiprocess=False)
    first = run_engines({**job, "phases": phases}, tmp_path, "first", multiprocess=False)
    assert cached(first[0]) == [0] and outputs(first[0]) == outputs(baseline[0])
    stored = [set(phase["store_keys"]) for phase in first]
    keys = [stored[0], stored[1] - stored[0], stored[2] - stored[1]]  # each request's entries
    assert [len(added) for added in keys] == [4, 4, 4]  # 2 chunks x (state group, attention group)
    # One of v's entries damaged: its load fails, vLLM recomputes the request (states and attention alike).
    flip_a_byte(store_dir, sorted(keys[1])[0])
    # Noise in u's states alone: the output changes, so the restored state is what the layers continue from.
    store = FileStore(store_dir)
    states = [key for key in keys[2] if json.loads(read_header(store.get(key) or b"")["__metadata__"]["shape"])[2] == 1]
    assert len(states) == 2
    for key in states:
        add_noise(store_dir, key)
    second = run_engines({**job, "phases": phases}, tmp_path, "second", multiprocess=False)
    assert cached(second[0]) == [576] and outputs(second[0]) == outputs(baseline[0])
    assert cached(second[1]) == [0] and outputs(second[1]) == outputs(baseline[1])
    assert cached(second[2]) == [576] and outputs(second[2]) != outputs(baseline[2])
