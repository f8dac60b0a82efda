"""``PrefixCache.generate`` saves the reply's full chunks as it generates them: a conversation's next turn
(the prompt, the reply, a new message) loads them, hybrids' states included, and answers as recomputing does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvgroups.integrations.transformers import PrefixCache  # noqa: E402
from kvgroups.store import MemoryStore  # noqa: E402
from tests.integrations.transformers.test_reuse import plain_logits  # noqa: E402
from tests.support.tiny_models import tiny_model  # noqa: E402

CHUNK = 8


@pytest.fixture(autouse=True)
def quiet_transformers() -> Iterator[None]:
    transformers.logging.set_verbosity_error()
    yield


def tokens(seed: int, length: int) -> torch.Tensor:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed))


# Full attention; sliding and full; gated DeltaNet and full; Mamba-2 and attention; Mamba-2 alone; MLA.
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_next", "bamba", "mamba2", "deepseek_v3"])
def test_the_next_turn_loads_the_reply_and_answers_as_recomputing_does(model_type: str) -> None:
    model = tiny_model(model_type)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        first = tokens(1, 21)  # 2 full chunks and 5 tokens; prefill saves the 2 (of 20), the reply the rest
        conversation = cache.generate(first, max_new_tokens=22)[0]
        cache.flush()
        assert conversation.shape == (43,)
        # The reply's tokens fed: to 42 (the last one never is): chunks 2, 3 and 4 end at 24, 32 and 40.
        assert cache.reply_chunks_saved == 3
        second = torch.cat([conversation, tokens(2, 6)])  # 49 tokens
        result = cache.prefill(second)
        assert (result.reused_tokens, result.computed_tokens) == (5 * CHUNK, 49 - 5 * CHUNK)
        plain = plain_logits(model, second)
        assert (result.logits - plain).abs().max() <= 1e-5 * max(1.0, float(plain.abs().max()))
        assert torch.equal(cache.generate(second, max_new_tokens=8),
                           model.generate(second[None], max_new_tokens=8, do_sample=False))


def test_without_save_reply_only_the_prompt_is_saved() -> None:
    model = tiny_model("llama")
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        conversation = cache.generate(tokens(1, 21), max_new_tokens=22, save_reply=False)[0]
        cache.flush()
        assert cache.reply_chunks_saved == 0
        assert cache.prefill(torch.cat([conversation, tokens(2, 6)])).reused_tokens == 2 * CHUNK


def test_assisted_decoding_runs_without_reuse_and_answers_as_transformers_does(
        caplog: pytest.LogCaptureFixture) -> None:
    """transformers' assisted decoding (prompt lookup here) continuing a cache it is handed answers otherwise
    than without one (5.25: its first token differs, kvgroups aside): PrefixCache.generate runs it on the
    prompt alone, says so, and neither reuses nor saves."""
    model = tiny_model("llama")
    first = torch.cat([tokens(1, 12)] * 2)[:21]  # repeats itself: prompt lookup finds candidates
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        cache.prefill(first)
        cache.flush()
        saved = cache.stats.saved_chunks
        assisted = cache.generate(first, max_new_tokens=30, prompt_lookup_num_tokens=4)
        cache.flush()
        assert torch.equal(assisted, model.generate(first[None], max_new_tokens=30, do_sample=False,
                                                    prompt_lookup_num_tokens=4))
        assert cache.stats.saved_chunks == saved and cache.reply_chunks_saved == 0
    assert "prompt_lookup_num_tokens (assisted decoding) is run without prefix reuse" in caplog.text
