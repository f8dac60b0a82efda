"""DeepSeek-V4 through ``PrefixCache``: a restored prefix leaves every tensor of the compressed layers as
computing it does (the window, each compressor's rows, its partial window and CSA's overlap, the counts),
at boundaries that split a compressor's window, in float32 and in bfloat16 (where the overlap gate is
float32), and the reused answer is the recomputed one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

from kvgroups.core.cache_specs import RecurrentState, SlidingWindow  # noqa: E402
from kvgroups.core.row_specs import CompressedRows  # noqa: E402
from kvgroups.integrations.transformers import VERIFIED_MODEL_TYPES, PrefixCache  # noqa: E402
from kvgroups.integrations.transformers.parts import PartRole  # noqa: E402
from kvgroups.store import MemoryStore  # noqa: E402

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


@pytest.fixture(autouse=True)
def quiet_transformers() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    yield


def tiny(dtype: torch.dtype, hca_rate: int = 16) -> Any:
    """Every kind of DeepSeek-V4 layer: window only, CSA (ratio 4, an indexer), HCA; tiny, random, eager."""
    config = transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=16, qk_rope_head_dim=4, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
        num_experts_per_tok=2, num_hash_layers=1, hc_mult=2, index_n_heads=2, index_head_dim=8, index_topk=64,
        sliding_window=10, max_position_embeddings=512, num_nextn_predict_layers=0,
        layer_types=["sliding_attention", CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: hca_rate}, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    return model.eval()


def layer_state(layer: Any) -> dict[str, Any]:
    """Everything a cache layer keeps, tensors and counts."""
    state: dict[str, Any] = {"keys": layer.keys, "values_are_keys": layer.values is layer.keys,
                             "length": int(layer.cumulative_length)}
    for field in ("compressed_kv", "buffer_kv", "buffer_gate", "entry_count", "overlap_kv", "overlap_gate"):
        for stream, value in (getattr(layer, field, None) or {}).items():
            state[f"{field}.{stream}"] = value
    return state


def assert_same_cache(restored: Any, computed: Any) -> None:
    for index, (ours, theirs) in enumerate(zip(restored.layers, computed.layers, strict=True)):
        assert type(ours) is type(theirs)
        ours_state, theirs_state = layer_state(ours), layer_state(theirs)
        assert ours_state.keys() == theirs_state.keys(), index
        for name, value in theirs_state.items():
            mine = ours_state[name]
            if isinstance(value, torch.Tensor):
                assert isinstance(mine, torch.Tensor) and mine.dtype == value.dtype, (index, name)
                assert torch.equal(mine, value), (index, name)
            else:
                assert mine == value, (index, name)


@pytest.mark.parametrize(("dtype", "chunk", "hca_rate"), [
    (torch.float32, 12, 16),  # a chunk that splits HCA's windows (and not CSA's)
    (torch.float32, 6, 16),  # one that splits both
    (torch.bfloat16, 8, 128),  # the real HCA ratio, never complete: all of it in the boundary's buffer
])
def test_a_restored_prefix_is_the_computed_cache(dtype: torch.dtype, chunk: int, hca_rate: int) -> None:
    model = tiny(dtype, hca_rate)
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(3, 256, (5 * chunk,), generator=generator)
    second = torch.cat([first[: 3 * chunk + 1], torch.randint(3, 256, (7,), generator=generator)])
    with PrefixCache(model, MemoryStore(), chunk_size=chunk, restore_check=False) as cache:
        cache.prefill(first)
        cache.flush()
        reused = cache.prefill(second)
    with PrefixCache(model, MemoryStore(), chunk_size=chunk, restore_check=False) as fresh:
        computed = fresh.prefill(second)
    assert (reused.reused_tokens, computed.reused_tokens) == (3 * chunk, 0)
    # The same forwards after the boundary, on the same bytes: equal to the last bit.
    assert torch.equal(reused.logits, computed.logits)
    assert_same_cache(reused.cache, computed.cache)
    with torch.no_grad():
        plain = model(second[None], logits_to_keep=1).logits[0, -1]
    assert float((reused.logits - plain).abs().max()) <= (2e-2 if dtype == torch.bfloat16 else 1e-5) * max(
        1.0, float(plain.abs().max()))


def test_every_compressor_tensor_is_a_part_of_its_kind() -> None:
    model = tiny(torch.bfloat16)
    with PrefixCache(model, MemoryStore(), chunk_size=8, restore_check=False) as cache:
        parts = {part.name: part for part in cache.binding.parts}
    assert "deepseek_v4" in VERIFIED_MODEL_TYPES
    window = SlidingWindow(window_tokens=9)  # transformers keeps sliding_window - 1 tokens
    assert {name for name, part in parts.items() if part.role is PartRole.SHARED_KV} == {
        f"layers.{index}.shared_kv" for index in (1, 2, 3)}
    assert all(parts[f"layers.{index}.shared_kv"].spec == window for index in (1, 2, 3))
    assert parts["layers.0.kv"].spec == window  # the window-only layer: transformers' own sliding layer
    assert parts["layers.1.compressed.indexer"].spec == CompressedRows(tokens_per_row=4)
    assert parts["layers.1.compressed.indexer"].shape == (1, 8)
    assert parts["layers.2.compressed.compressor"].spec == CompressedRows(tokens_per_row=16)
    assert "layers.2.overlap_kv.compressor" not in parts  # HCA's windows do not overlap
    assert parts["layers.1.buffer_kv.compressor"].spec == RecurrentState(state_shapes=((4, 32),))
    assert parts["layers.1.overlap_gate.compressor"].dtype == torch.float32  # the position bias's
    assert parts["layers.1.overlap_kv.compressor"].dtype == torch.bfloat16


def test_greedy_tokens_after_reuse_are_generates() -> None:
    model = tiny(torch.float32)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 256, (45,), generator=generator)
    with PrefixCache(model, MemoryStore(), chunk_size=12, restore_check=False) as cache:
        cache.prefill(prompt)
        cache.flush()
        ours = cache.generate(prompt, max_new_tokens=8)
        assert cache.last_prefill is not None and cache.last_prefill.reused_tokens == 36
    theirs = model.generate(prompt[None], max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs)
