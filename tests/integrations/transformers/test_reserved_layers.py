"""ReservedDynamicLayer against transformers' DynamicLayer: the same keys and values after any sequence of
updates, crops and batch reorders, and nothing handed out before ever changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

from transformers.cache_utils import DynamicLayer

from kvgroups.integrations.transformers.reserved_layers import ReservedDynamicLayer

HEADS, KEY_DIM, VALUE_DIM = 2, 4, 3


def states(generator: torch.Generator, tokens: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch, HEADS, tokens, KEY_DIM, generator=generator),
            torch.randn(batch, HEADS, tokens, VALUE_DIM, generator=generator))


actions = st.one_of(
    st.tuples(st.just("update"), st.integers(0, 6)),
    st.tuples(st.just("crop"), st.integers(1, 3)),
    st.tuples(st.just("repeat"), st.just(2)),
    st.tuples(st.just("select"), st.just(0)),
    st.tuples(st.just("other dtype"), st.integers(1, 3)),
)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 8), st.integers(0, 10), st.lists(actions, max_size=8), st.integers(0, 2**16))
def test_a_reserved_layer_holds_what_a_dynamic_layer_holds(restored: int, room: int, steps: list[tuple[str, int]],
                                                           seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    keys, values = states(generator, restored)
    key_buffer = torch.full((1, HEADS, restored + room, KEY_DIM), float("nan"))
    value_buffer = torch.full((1, HEADS, restored + room, VALUE_DIM), float("nan"))
    key_buffer[:, :, :restored], value_buffer[:, :, :restored] = keys, values
    reserved = ReservedDynamicLayer(key_buffer, value_buffer, restored)
    plain = DynamicLayer()
    plain.update(keys, values)
    handed_out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for action, amount in steps:
        batch = plain.keys.shape[0]
        if action == "update":
            new = states(generator, amount, batch)
            got = reserved.update(*new)
            want = plain.update(*new)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            handed_out.append((got[0], got[0].clone()))
        elif action == "other dtype":
            new = tuple(tensor.double() for tensor in states(generator, amount, batch))
            reserved.keys, reserved.values = reserved.keys.double(), reserved.values.double()
            plain.keys, plain.values = plain.keys.double(), plain.values.double()
            assert all(torch.equal(a, b) for a, b in zip(reserved.update(*new), plain.update(*new), strict=True))
        elif action == "crop":
            if plain.get_seq_length() >= amount:
                reserved.crop(-amount)
                plain.crop(-amount)
        elif action == "repeat":
            reserved.batch_repeat_interleave(amount)
            plain.batch_repeat_interleave(amount)
        else:
            reserved.batch_select_indices(torch.tensor([0]))
            plain.batch_select_indices(torch.tensor([0]))
        assert torch.equal(reserved.keys, plain.keys) and torch.equal(reserved.values, plain.values), (action, amount)
        assert reserved.get_seq_length() == plain.get_seq_length()
        for tensor, snapshot in handed_out:  # what an update returned never changes afterwards
            assert torch.equal(tensor, snapshot)


def test_an_update_that_fits_writes_in_place_and_one_that_does_not_falls_back() -> None:
    generator = torch.Generator().manual_seed(0)
    key_buffer, value_buffer = torch.zeros(1, HEADS, 10, KEY_DIM), torch.zeros(1, HEADS, 10, VALUE_DIM)
    layer = ReservedDynamicLayer(key_buffer, value_buffer, 4)
    assert layer.reserved_tokens == 6
    keys, _ = layer.update(*states(generator, 5))
    assert keys.data_ptr() == key_buffer.data_ptr() and keys.shape[-2] == 9 and layer.reserved_tokens == 1
    keys, _ = layer.update(*states(generator, 2))  # one more than the room: DynamicLayer's copy
    assert keys.data_ptr() != key_buffer.data_ptr() and keys.shape[-2] == 11 and layer.reserved_tokens == 0
    assert torch.equal(keys[:, :, :9], key_buffer[:, :, :9])


def test_keys_replaced_from_outside_are_never_written_over() -> None:
    """An offload or anything else that sets the layer's keys makes the buffers stale: updates copy."""
    generator = torch.Generator().manual_seed(1)
    key_buffer, value_buffer = torch.zeros(1, HEADS, 10, KEY_DIM), torch.zeros(1, HEADS, 10, VALUE_DIM)
    layer = ReservedDynamicLayer(key_buffer, value_buffer, 3)
    replaced: Any = (torch.ones(1, HEADS, 3, KEY_DIM), torch.ones(1, HEADS, 3, VALUE_DIM))
    layer.keys, layer.values = replaced
    assert layer.reserved_tokens == 0
    new = states(generator, 2)
    keys, values = layer.update(*new)
    assert torch.equal(keys, torch.cat([replaced[0], new[0]], dim=-2))
    assert torch.equal(values, torch.cat([replaced[1], new[1]], dim=-2))
    assert not key_buffer.any() and not value_buffer.any()


def test_buffers_too_small_for_the_restored_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match=r"buffers of 2 and 2 tokens cannot hold 3"):
        ReservedDynamicLayer(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 3)
    with pytest.raises(ValueError, match=r"buffers of 2 and 5 tokens"):
        ReservedDynamicLayer(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 5, 4), 1)


def test_a_restored_prefix_gets_room_for_the_prompts_other_tokens_and_answers_exactly() -> None:
    """PrefixCache restores a llama's layers with room for the rest of the prompt: its forward writes the
    suffix behind the restored tokens, in place, and the logits are a plain forward's, bit for bit."""
    import transformers

    from kvgroups.integrations.transformers import PrefixCache
    from kvgroups.store import MemoryStore
    from tests.integrations.transformers.test_reuse import CHUNK, plain_logits, prompts
    from tests.support.tiny_models import tiny_model

    transformers.logging.set_verbosity_error()
    model = tiny_model("llama")
    first, second = prompts()
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        cache.prefill(first)
        cache.flush()
        result = cache.prefill(second)
    assert result.reused_tokens == 3 * CHUNK
    layers = result.cache.layers
    assert [type(layer) for layer in layers] == [ReservedDynamicLayer] * len(layers)
    # The prompt's 40 tokens fill the room exactly: nothing was copied into a new tensor.
    assert all(layer.reserved_tokens == 0 and layer.keys.shape[-2] == 40 and layer._buffers is not None
               for layer in layers)
    assert torch.equal(result.logits, plain_logits(model, second))
