"""PrefixCache refuses exactly the caches it cannot store and restore, whatever the model type says:
cache-layer subclasses that keep state of their own, positions before the tokens, caches that grow
past the model's layers, forwards that return no cache, linear-attention layers left without
state; and skips the layers a text-only forward leaves empty (mllama's cross-attention layers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvgroups.errors import UnsupportedCacheError  # noqa: E402
from kvgroups.integrations.transformers import prefix_cache  # noqa: E402
from kvgroups.integrations.transformers.cache_parts import PartRole, read_parts  # noqa: E402
from kvgroups.store import MemoryStore  # noqa: E402
from tests.support.model_type_recipes import build_config  # noqa: E402


@pytest.fixture(autouse=True)
def any_model_type(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What the cache holds decides here, not the model type's verdict."""
    monkeypatch.setattr(prefix_cache, "check_supported", lambda model: None)
    transformers.logging.set_verbosity_error()
    yield


def tiny(model_type: str, **changes: Any) -> Any:
    config = build_config(model_type)
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()


@pytest.mark.parametrize(("model_type", "message"), [
    ("cpmant", r"cache layer 0 holds 33 positions after a one-token forward"),
    ("dory", r"the model's forward grew its cache from 4 to 6 layers"),
    ("recurrent_gemma", r"the model's forward returns no cache, not the DynamicCache it was given"),
])
def test_caches_that_cannot_be_restored_are_refused(model_type: str, message: str) -> None:
    with pytest.raises(UnsupportedCacheError, match=message):
        prefix_cache.PrefixCache(tiny(model_type), MemoryStore(), chunk_size=8)


def test_a_linear_attention_layer_without_state_is_refused() -> None:
    cache = transformers.DynamicCache(config=build_config("qwen3_next"))  # no forward: every layer empty
    with pytest.raises(UnsupportedCacheError, match=r"cache layer 0 \(LinearAttentionLayer\) holds no state after a "
                                                    r"forward"):
        read_parts(cache)


def test_layers_a_text_forward_leaves_empty_are_skipped() -> None:
    with prefix_cache.PrefixCache(tiny("mllama"), MemoryStore(), chunk_size=8) as cache:
        parts = cache.binding.parts
        assert [(part.layer_index, part.role) for part in parts] == [(index, PartRole.KV) for index in range(3)]
        assert [part.shape for part in parts] == [(2, 16)] * 3
