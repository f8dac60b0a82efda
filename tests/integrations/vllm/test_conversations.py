"""Conversations on vLLM engines (each in a fresh process): the next turn loads the previous reply.

A turn's prompt is the previous turn's prompt, its reply and a new message (the engine runner's
``reply_then``). With decode saves (the default) every full chunk of a reply is saved while it is
generated, so each turn loads all of its history that fills whole chunks, with ngram speculative
decoding and without it. The answers are compared with two references run alike: recomputing every
turn (tokens equal; logprobs as close as vLLM's own reuse of the reply's KV gets, since a token's KV
computed while decoding differs in the last bits from the same KV computed in a prefill), and vLLM's
own prefix cache serving the same tokens from the same decode-time KV (tokens and logprobs equal,
bit for bit: the store hands back exactly what was computed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.engine_runner import outputs, run_job
from tests.integrations.vllm.tiny_vllm_models import save_model

CHUNK = 256
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def prompt(seed: int, length: int) -> list[int]:
    return [4 + (index * 37 + seed * 101 + 11) % 508 for index in range(length)]


def cached(phases: list[dict[str, Any]]) -> list[int]:
    return [phase["outputs"][0]["num_cached_tokens"] for phase in phases]


def turns(first: list[int], replies: tuple[int, ...], messages: tuple[int, ...]) -> list[dict[str, Any]]:
    """A conversation: ``first``, then each message after the reply before it."""
    phases: list[dict[str, Any]] = [{"requests": [{"prompt_token_ids": first}], "max_tokens": replies[0]}]
    phases += [{"reply_then": [prompt(seed, length)], "max_tokens": reply}
               for seed, (length, reply) in enumerate(zip(messages, replies[1:], strict=True), start=20)]
    return phases


def assert_close_to(got: list[dict[str, Any]], recomputed: list[dict[str, Any]]) -> None:
    """Each turn's tokens equal; their logprobs within what KV computed while decoding moves them."""
    for mine, theirs in zip(got, recomputed, strict=True):
        (tokens, logprobs), (want_tokens, want_logprobs) = outputs(mine)[0], outputs(theirs)[0]
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_each_turn_of_a_conversation_loads_every_full_chunk_of_the_replies_before_it(tmp_path: Path,
                                                                                     speculative: bool) -> None:
    """1000 prompt tokens and an 80-token reply crossing 1024; a 150-token message and a reply crossing
    1280; a last message. (Without decode saves these turns load 768 and 1024, measured once; that the
    reply's chunks are then not saved is test_decode_saves.py's, on vLLM's Scheduler.)"""
    model = str(save_model("llama", tmp_path / "llama"))
    store_dir = tmp_path / "kv"
    # vLLM's blocks as large as a chunk, so that its own prefix cache hits where the store does.
    job: dict[str, Any] = {"model": model, "block_size": CHUNK, "store_dir": str(store_dir),
                           "phases": turns(prompt(0, 1000), (80, 80, 8), (150, 40))}
    if speculative:
        job["speculative_config"] = NGRAM
    connector = {"store": f"file://{store_dir}", "chunk_size": CHUNK}
    recomputed = run_job({**job, "connector": None}, tmp_path, "recomputed", multiprocess=False)
    own_cache = run_job({**job, "connector": None, "prefix_caching": True}, tmp_path, "own-cache", multiprocess=False)
    stored = run_job({**job, "connector": connector}, tmp_path, "stored", multiprocess=False)
    assert [len(output["token_ids"]) for phase in stored for output in phase["outputs"]] == [80, 80, 8]
    assert cached(own_cache) == cached(stored) == [0, 1024, 1280]
    # Chunks 0-2 of the prompt, then chunk 3 (1024) and chunk 4 (1280), each saved as its reply crossed it.
    assert [len(phase["store_keys"]) for phase in stored] == [4, 5, 5]
    assert [outputs(phase) for phase in stored] == [outputs(phase) for phase in own_cache]
    assert_close_to(stored, recomputed)


def test_a_hybrids_conversation_loads_each_reply_with_its_state(tmp_path: Path) -> None:
    """qwen3-next-like under vLLM's defaults (prefix caching on, states on its grid of 288 tokens): a
    560-token prompt and a reply crossing 576, a message and a reply crossing 864. Each turn loads the
    previous reply's chunk with the state after its last token. The reference is vLLM's own prefix cache
    told to keep every state (``prefix_cache_retention_interval`` None), the same tokens from the same
    decode-time states; recomputing differs (a state computed token by token while decoding differs in
    bfloat16 from the one a prefill's chunked scan computes), as vLLM's own reuse of it does."""
    model = str(save_model("qwen3_next", tmp_path / "qwen3_next"))
    store_dir = tmp_path / "kv"
    job: dict[str, Any] = {"model": model, "prefix_caching": True, "dtype": "bfloat16",
                           "mamba_ssm_cache_dtype": "float32", "cpu_attention_kernels": "vec",
                           "store_dir": str(store_dir), "phases": turns(prompt(1, 560), (40, 40, 8), (250, 30))}
    own_cache = run_job({**job, "connector": None, "prefix_cache_retention_interval": None}, tmp_path, "own-cache",
                        multiprocess=False)
    stored = run_job({**job, "connector": {"store": f"file://{store_dir}"}}, tmp_path, "stored", multiprocess=False)
    assert {phase["block_size"] for phase in stored} == {288}
    assert cached(own_cache) == cached(stored) == [0, 576, 864]
    # Turn by turn: the prompt's chunk 0 (its step ended at 288: K/V and state), the reply's chunk 1 (K/V and
    # the state at 576), the next turn's prompt adds none whole, its reply chunk 2 (the state at 864).
    assert [len(phase["store_keys"]) for phase in stored] == [4, 6, 6]
    counts = stored[-1]["connector_counts"]
    assert counts["stateless_saves"] == 0 and counts["decode_saves"] == 2 and counts["decode_chunk_loads"] == 2
    assert [outputs(phase) for phase in stored] == [outputs(phase) for phase in own_cache]


def test_vllms_cpu_build_cannot_speculate_on_a_hybrid(tmp_path: Path) -> None:
    """Why a hybrid's decode saves under speculative decoding are tested on vLLM's real Scheduler with a
    stand-in model (test_decode_saves.py) rather than on an engine: vLLM's CPU build fails in its own code,
    without the connector, on the first step (its align-mode state copy is a Triton kernel, absent on CPUs).
    A release that runs it fails this test: then test the hybrid's conversation above under ngram too."""
    model = str(save_model("qwen3_next", tmp_path / "qwen3_next"))
    job = {"model": model, "prefix_caching": True, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32",
           "cpu_attention_kernels": "vec", "speculative_config": NGRAM, "connector": None,
           "phases": [{"requests": [{"prompt_token_ids": prompt(1, 100)}], "max_tokens": 8}]}
    with pytest.raises(RuntimeError, match=r"precopy_mamba_align_fused_kernel\[grid\]"):
        run_job(job, tmp_path, "speculating-hybrid", multiprocess=False)
