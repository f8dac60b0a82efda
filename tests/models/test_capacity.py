"""Memory for a context, and context for a memory, with windows, chunks and states."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups.cli.report import inspect_model
from kvgroups.core.cache_specs import ChunkedLocal, FullAttention, RecurrentState, SlidingWindow
from kvgroups.core.sizes import GIB
from kvgroups.models.capacity import Fit, GroupCost, memory_needed, tokens_that_fit
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams
from kvgroups.models.presets import load_model_config

FULL = GroupCost(spec=FullAttention(), bytes_per_token=100, bytes_per_sequence=0)
SLIDING = GroupCost(spec=SlidingWindow(window_tokens=40), bytes_per_token=10, bytes_per_sequence=0)
CHUNKED = GroupCost(spec=ChunkedLocal(chunk_tokens=64), bytes_per_token=1, bytes_per_sequence=0)
STATE = GroupCost(spec=RecurrentState(state_shapes=((3,),)), bytes_per_token=0, bytes_per_sequence=7)


def test_memory_needed_by_hand() -> None:
    # 1000 tokens, block 16: full holds 63 blocks; the window 40 -> 48 + 16 = 64 tokens = 4 blocks;
    # the chunk 64 tokens = 4 blocks; the state 7 B; two sequences.
    costs = [FULL, SLIDING, CHUNKED, STATE]
    assert memory_needed(costs, 1000, 2, 16, hybrid=True) == 2 * (63 * 16 * 100 + 4 * 16 * 10 + 4 * 16 * 1 + 7)
    assert memory_needed(costs, 1000, 2, 16, hybrid=False) == 2 * (63 * 16 * 111 + 7)
    assert memory_needed(costs, 20, 1, 16, hybrid=True) == 2 * 16 * 111 + 7  # short context: windows not full


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([FULL, SLIDING, CHUNKED, STATE]), min_size=1, max_size=4),
    st.integers(0, 60_000), st.integers(1, 3), st.sampled_from([1, 16]), st.booleans(),
)
def test_tokens_that_fit_is_the_largest_fitting_context(
    costs: list[GroupCost], budget: int, sequences: int, block_size: int, hybrid: bool
) -> None:
    fit = tokens_that_fit(costs, budget, sequences, block_size, 2000, hybrid=hybrid)
    fitting = [t for t in range(2001) if memory_needed(costs, t, sequences, block_size, hybrid=hybrid) <= budget]
    expected = max(fitting) if fitting else 0
    assert fit.tokens_per_sequence == expected
    assert fit.limited_by == ("max_position_embeddings" if expected == 2000 else "memory")


def test_sliding_models_fit_far_more_than_all_full() -> None:
    spec = model_spec_from_config(load_model_config("gemma-3-27b-it").config)
    report = inspect_model(spec, "g", EngineParams(tp=2, memory_gib=4, tokens=131072)).to_dict()
    memory, tokens = report["capacity"]["memory"], report["capacity"]["tokens"]
    assert memory["tokens_per_sequence_all_full"] < memory["tokens_per_sequence"]
    per_token_full = 10 * 2 * 8 * 128 * 2  # the 10 global layers, 8 kv heads per rank
    per_token_sliding = 52 * 2 * 8 * 128 * 2
    held_sliding = 1024 + 16  # window rounded to blocks, plus one block
    assert tokens["bytes_per_rank"] == 131072 * per_token_full + held_sliding * per_token_sliding
    assert tokens["bytes_per_rank_all_full"] == 131072 * (per_token_full + per_token_sliding)
    budget = 4 * GIB
    assert memory["tokens_per_sequence"] == (budget - held_sliding * per_token_sliding) // per_token_full // 16 * 16


def test_a_context_nothing_limits_is_unbounded() -> None:
    assert tokens_that_fit([STATE], 100, 2, 16, None, hybrid=True) == Fit(tokens_per_sequence=None,
                                                                           limited_by="unbounded")
    assert tokens_that_fit([STATE], 100, 2, 16, 4096, hybrid=True).tokens_per_sequence == 4096
    assert tokens_that_fit([STATE], 13, 2, 16, None, hybrid=True).tokens_per_sequence == 0  # 2 states do not fit
    report = inspect_model(model_spec_from_config(load_model_config("falcon-mamba-7b").config), "m",
                           EngineParams(memory_gib=1, seqs=8)).to_dict()
    memory = report["capacity"]["memory"]
    assert (memory["tokens_per_sequence"], memory["total_tokens"], memory["limited_by"]) == (None, None, "unbounded")


def test_a_cost_without_a_spec_is_a_fixed_amount_per_sequence() -> None:
    images = GroupCost(spec=None, bytes_per_token=0, bytes_per_sequence=1000)
    for hybrid in (True, False):
        assert memory_needed([FULL, images], 32, 3, 16, hybrid=hybrid) == 3 * (32 * 100 + 1000)
