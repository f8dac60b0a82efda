"""Prefix reuse with transformers models: the reused answer is the recomputed one, for every supported
architecture (hybrids included), across processes and servers, and under every store failure."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.paths import ROOT

transformers = pytest.importorskip("transformers")

from kvgroups import KVGroupsError  # noqa: E402
from kvgroups.integrations.transformers import (  # noqa: E402
    REFUSED_MODEL_TYPES,
    VERIFIED_MODEL_TYPES,
    PrefixCache,
    UnsupportedModelError,
)
from kvgroups.store import FileStore, MemoryStore  # noqa: E402
from tests.support.servers import running_server  # noqa: E402
from tests.support.tiny_models import CONFIGS, tiny_model  # noqa: E402

CHUNK = 8
# The types built here by hand (tests/support/tiny_models.py); every other type is held to the same protocol by
# the sweep (tests/models/test_model_type_sweep.py).
SUPPORTED = sorted(set(CONFIGS) - {"jamba"})


@pytest.fixture(autouse=True)
def quiet_transformers() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    yield


def prompts(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A, and B sharing A's first 3 full chunks and 3 tokens more (diverging mid-chunk)."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(3, 256, (40,), generator=generator)
    second = torch.cat([first[: 3 * CHUNK + 3], torch.randint(3, 256, (13,), generator=generator)])
    return first, second


def plain_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits of one plain forward, as generate's prefill computes them."""
    with torch.no_grad():
        return model(ids[None], logits_to_keep=1).logits[0, -1]  # type: ignore[no-any-return]


def assert_same_answer(model: Any, cache: PrefixCache, ids: torch.Tensor, logits: torch.Tensor, *,
                       exact: bool = False) -> None:
    plain = plain_logits(model, ids)
    if exact:
        assert torch.equal(logits, plain)
    else:
        assert (logits - plain).abs().max() <= 1e-5 * max(1.0, float(plain.abs().max()))
    ours = cache.generate(ids, max_new_tokens=16)
    assert torch.equal(ours, model.generate(ids[None], max_new_tokens=16, do_sample=False))


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_a_shared_prefix_is_reused_and_the_answer_is_the_recomputed_one(model_type: str) -> None:
    model = tiny_model(model_type)
    first, second = prompts()
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        result = cache.prefill(first)
        assert (result.reused_tokens, result.computed_tokens) == (0, 40)
        cache.flush()
        result = cache.prefill(second)
        assert (result.reused_tokens, result.computed_tokens) == (3 * CHUNK, 40 - 3 * CHUNK)
        assert_same_answer(model, cache, second, result.logits, exact=model_type == "llama")


def test_keys_and_values_of_their_own_head_sizes_are_stored_unpadded() -> None:
    """MiMo-V2-Flash's layers cache keys of one head size and values of another (here 24 / 16): one
    group per kind, each chunk row a token's keys then its values, and the answer the recomputed one."""
    model = tiny_model("mimo_v2_flash")
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        assert [(group.kind.value, group.num_heads, group.head_size, group.value_head_size,
                 list(group.chunk_shape(CHUNK))) for group in cache.groups] == [
            ("full_attention", 2, 24, 16, [1, 2, CHUNK, 2 * (24 + 16)]),
            ("sliding_window", 4, 24, 16, [1, 2, CHUNK, 4 * (24 + 16)])]
        generator = torch.Generator().manual_seed(7)
        long = torch.randint(3, 256, (72,), generator=generator)  # past the window of 16
        cache.prefill(long)
        cache.flush()
        result = cache.prefill(long[:70])
        assert (result.reused_tokens, result.computed_tokens) == (64, 6)
        assert_same_answer(model, cache, long[:70], result.logits)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_llama_is_exact(attention: str) -> None:
    model = tiny_model("llama", attention=attention)
    first, second = prompts(seed=5)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        cache.prefill(first)
        cache.flush()
        result = cache.prefill(second)
        assert result.reused_tokens == 24 and torch.equal(result.logits, plain_logits(model, second))


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_next", "bamba", "mamba2"])
def test_short_prompts_one_chunk_and_prefixes_longer_than_the_window(model_type: str) -> None:
    model = tiny_model(model_type)
    generator = torch.Generator().manual_seed(3)
    long = torch.randint(3, 256, (72,), generator=generator)  # 9 chunks, well past the window of 16
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        short = cache.prefill(long[:5])
        assert (short.reused_tokens, short.computed_tokens) == (0, 5)
        assert_same_answer(model, cache, long[:5], short.logits)
        one = cache.prefill(long[:CHUNK])  # a whole chunk: stored, but one token is always computed
        cache.flush()
        assert one.reused_tokens == 0
        assert cache.prefill(long[:CHUNK]).reused_tokens == 0
        assert cache.prefill(long[: CHUNK + 1]).reused_tokens == CHUNK
        cache.prefill(long)
        cache.flush()
        result = cache.prefill(long[:70])
        assert result.reused_tokens == 64
        assert_same_answer(model, cache, long[:70], result.logits)


def test_refused_and_bad_input() -> None:
    with pytest.raises(UnsupportedModelError, match=r"refused for model_type 'jamba': its mamba \(v1\) layers"):
        PrefixCache(tiny_model("jamba"), MemoryStore())
    unknown = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2,
                                                                                    vocab_size=64))
    unknown.config.model_type = "brand_new"  # a type this transformers does not know
    with pytest.raises(UnsupportedModelError, match=r"has not been checked for model_type 'brand_new' \(not a "
                                                    r"causal-LM type of transformers 5\.\d+\.\d+\); checked: .*llama"):
        PrefixCache(unknown, MemoryStore())
    with PrefixCache(tiny_model("llama"), MemoryStore(), chunk_size=CHUNK) as cache:
        with pytest.raises(KVGroupsError, match=r"one sequence at a time; got a batch of 2"):
            cache.prefill(torch.zeros(2, 10, dtype=torch.int64))
        with pytest.raises(KVGroupsError, match=r"input_ids must be a non-empty"):
            cache.prefill(torch.zeros(0, dtype=torch.int64))


def stored_model(tmp_path: Path, model_type: str) -> Path:
    directory = tmp_path / model_type
    tiny_model(model_type).save_pretrained(directory)
    return directory


FILL_AND_REPORT = """
    import json, sys, torch, transformers
    transformers.logging.set_verbosity_error()
    from kvgroups.integrations.transformers import PrefixCache
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True, dtype=torch.float32)
    ids = torch.tensor(json.loads(sys.argv[3]))
    with PrefixCache(model.eval(), sys.argv[2], chunk_size=8) as cache:
        result = cache.prefill(ids)
        print(json.dumps([result.reused_tokens, result.logits.tolist()]))
"""


def in_process(model_dir: Path, store: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    command = [sys.executable, "-c", textwrap.dedent(FILL_AND_REPORT), str(model_dir), store, json.dumps(ids.tolist())]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    reused, logits = json.loads(result.stdout.strip().splitlines()[-1])
    return reused, torch.tensor(logits)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_another_process_reuses_a_file_store(tmp_path: Path, model_type: str) -> None:
    model_dir = stored_model(tmp_path, model_type)
    first, second = prompts()
    url = f"file://{tmp_path}/kv"
    assert in_process(model_dir, url, first)[0] == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with PrefixCache(model, url, chunk_size=CHUNK) as cache:
        result = cache.prefill(second)
        assert result.reused_tokens == 24
        assert_same_answer(model, cache, second, result.logits)


def test_another_process_reuses_a_redis_server(tmp_path: Path) -> None:
    model_dir = stored_model(tmp_path, "gemma3_text")
    first, second = prompts()
    with running_server(tmp_path / "server") as server:
        assert in_process(model_dir, server.url, first)[0] == 0
        reused, logits = in_process(model_dir, server.url, second)
    assert reused == 24
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    plain = plain_logits(model, second)
    assert (logits - plain).abs().max() <= 1e-5 * max(1.0, float(plain.abs().max()))


def test_a_broken_store_costs_reuse_never_the_answer(tmp_path: Path) -> None:
    model = tiny_model("bamba")
    first, second = prompts()
    url = f"file://{tmp_path}/kv"
    with PrefixCache(model, url, chunk_size=CHUNK) as cache:
        cache.prefill(first)
        cache.flush()
        store = FileStore(f"{tmp_path}/kv")
        keys = cache.chunk_store.keys(first)
        # A flipped byte in the K/V of chunk 2 of the attention group.
        attention = next(index for index, group in enumerate(cache.groups) if group.token_indexed)
        victim = Path(store._path(cache.chunk_store.entry_key(keys[2], attention)))
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x40
        victim.write_bytes(bytes(data))
        result = cache.prefill(second)
        assert result.reused_tokens == 16  # chunk 2 is refused, chunks 0-1 serve
        assert_same_answer(model, cache, second, result.logits)
        cache.flush()
        # Evicted recurrent states after chunks 1-3 (the K/V are all there): only chunk 0's boundary serves.
        recurrent = next(index for index, group in enumerate(cache.groups) if not group.token_indexed)
        for key in cache.chunk_store.keys(second)[1:4]:
            assert store.delete(cache.chunk_store.entry_key(key, recurrent))
        result = cache.prefill(second)
        assert result.reused_tokens == 8
        assert_same_answer(model, cache, second, result.logits)
    with PrefixCache(model, url, chunk_size=CHUNK, salt="another tenant") as salted:
        result = salted.prefill(second)
        assert result.reused_tokens == 0
        assert_same_answer(model, salted, second, result.logits)


@pytest.mark.parametrize("changes", [dict(num_key_value_heads=4), dict(dtype=torch.float64), dict(seed=1)],
                         ids=["one more kv head", "another dtype", "other weights"])
def test_a_different_model_never_reuses_anothers_chunks(changes: dict[str, Any]) -> None:
    store = MemoryStore()
    first, second = prompts()
    with PrefixCache(tiny_model("llama"), store, chunk_size=CHUNK) as cache:
        cache.prefill(first)
        cache.flush()
    dtype = changes.pop("dtype", None)
    other = tiny_model("llama", **changes)
    if dtype is not None:
        other = other.to(dtype)
    with PrefixCache(other, store, chunk_size=CHUNK) as cache:
        result = cache.prefill(second)
        assert result.reused_tokens == 0
        assert_same_answer(other, cache, second, result.logits)


def test_every_tiny_config_is_a_supported_or_refused_type() -> None:
    assert set(SUPPORTED) <= VERIFIED_MODEL_TYPES and "jamba" in REFUSED_MODEL_TYPES
