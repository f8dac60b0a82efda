"""Sparse-attention MLA models the sweep refuses for what transformers itself does, their indexer choosing other
keys in other chunks once a context exceeds ``index_topk``, shown restored right with ``index_topk`` above the
prompts: dots3, whose sliding layers keep MLA latents in a window (two windowed MLA-layout parts, the latent and
its rope key), and hy_v4.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.dots3_note")

from kvgroups.core.cache_specs import SlidingWindow  # noqa: E402
from kvgroups.core.layouts import KVLayout  # noqa: E402
from kvgroups.integrations.transformers import prefix_cache  # noqa: E402
from kvgroups.integrations.transformers.parts import PartRole  # noqa: E402
from kvgroups.store import MemoryStore  # noqa: E402
from tests.support import model_type_recipes, model_type_sweep  # noqa: E402

CHUNK = 8


@pytest.fixture
def dots3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    transformers.logging.set_verbosity_error()
    overrides = {**model_type_recipes.OVERRIDES.get("dots3_note_text", {}), "index_topk": 64}
    monkeypatch.setitem(model_type_recipes.OVERRIDES, "dots3_note_text", overrides)
    monkeypatch.setattr(prefix_cache, "check_supported", lambda model: None)  # refused for its indexer (above)
    yield model_type_sweep.build_model("dots3_note_text", "a")


def test_windowed_latents_restore_as_computed(dots3: Any) -> None:
    first, second = model_type_sweep.prompts()
    with prefix_cache.PrefixCache(dots3, MemoryStore(), chunk_size=CHUNK, restore_check=False) as cache:
        parts = {part.name: part for part in cache.binding.parts}
        cache.prefill(first)
        cache.flush()
        reused = cache.prefill(second)
    window = SlidingWindow(window_tokens=dots3.config.sliding_window - 1)
    assert [(part.role, part.spec, part.layout) for name, part in parts.items() if name.startswith("layers.2.")] == [
        (PartRole.KEYS, window, KVLayout.MLA), (PartRole.VALUES, window, KVLayout.MLA)]
    with prefix_cache.PrefixCache(dots3, MemoryStore(), chunk_size=CHUNK, restore_check=False) as fresh:
        computed = fresh.prefill(second)
    assert reused.reused_tokens == 3 * CHUNK
    assert torch.equal(reused.logits, computed.logits)
    for index in (2, 3):  # the sliding layers: the window restored is the window computed
        ours, theirs = reused.cache.layers[index], computed.cache.layers[index]
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_hy_v4s_greedy_difference_is_its_indexers_not_reuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """hy_v4 (MLA and a sparse indexer) continues a restored prefix with logits equal to recomputing, but its greedy
    tokens after reuse differ from model.generate's: so do those of a PrefixCache that reused nothing (its prefill
    runs chunk by chunk), because the indexer picks other keys in other chunks once the context exceeds index_topk.
    With index_topk above the prompts, reuse answers exactly as model.generate does."""
    transformers.logging.set_verbosity_error()
    monkeypatch.setattr(prefix_cache, "check_supported", lambda model: None)
    _, second = model_type_sweep.prompts()
    model = model_type_sweep.build_model("hy_v4", "a")
    assert model.config.index_topk < len(second)
    with prefix_cache.PrefixCache(model, MemoryStore(), chunk_size=CHUNK, restore_check=False) as cache:
        nothing_reused = cache.generate(second, max_new_tokens=8)
        assert cache.last_prefill is not None and cache.last_prefill.reused_tokens == 0
    theirs = model.generate(second[None], max_new_tokens=8, do_sample=False)
    assert not torch.equal(nothing_reused, theirs)
    monkeypatch.setitem(model_type_recipes.OVERRIDES, "hy_v4",
                        {**model_type_recipes.OVERRIDES.get("hy_v4", {}), "index_topk": 64})
    assert model_type_sweep.reuse_failure(model_type_sweep.build_model("hy_v4", "a")) is None
