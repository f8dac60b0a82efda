"""How much memory a context needs and how much context a memory holds, block by block.

Each group is allocated in whole blocks of ``block_size`` tokens; a group holds as many tokens
as its kind keeps (its spec's ``tokens_held``); a recurrent group holds one state per sequence,
and a cost without a spec (the image tokens of cross-attention layers) a fixed amount per
sequence. "As if every layer were full" counts every token layer as full attention, which is
what an engine without a hybrid allocator reserves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgroups.core.cache_specs import FullAttention, LayerCacheSpec
from kvgroups.core.sizes import round_up

_FULL = FullAttention()
# Search ceiling when the model states no maximum context.
_UNBOUNDED_TOKENS = 1 << 40


@dataclass(frozen=True, kw_only=True)
class GroupCost:
    """What one group costs on one rank."""

    spec: LayerCacheSpec | None  # None: a fixed cost per sequence (no tokens)
    bytes_per_token: float  # all layers of the group together; 0 for recurrent state
    bytes_per_sequence: int  # recurrent state of all layers of the group; 0 for token caches
    block_tokens: int | None = None  # the group's own block (an engine that fixes its pages); None: the engine's


def memory_needed(
    costs: Sequence[GroupCost], context_tokens: int, num_sequences: int, block_size: int, *, hybrid: bool
) -> int:
    """Bytes one rank needs for ``num_sequences`` sequences of ``context_tokens`` each."""
    per_sequence = 0
    for cost in costs:
        if cost.bytes_per_token:
            spec = cost.spec if hybrid and cost.spec is not None else _FULL
            block = cost.block_tokens or block_size
            held = spec.tokens_held(context_tokens, block)
            # Whole blocks: a fraction per token (compressed rows) makes whole bytes per block.
            per_sequence += math.ceil(round_up(held, block) * cost.bytes_per_token)
        per_sequence += cost.bytes_per_sequence
    return per_sequence * num_sequences


@dataclass(frozen=True, kw_only=True)
class Fit:
    """The longest context per sequence that fits a memory budget."""

    tokens_per_sequence: int | None  # None: unbounded (nothing grows with the context, no maximum)
    limited_by: str  # "memory", "max_position_embeddings" or "unbounded"


def tokens_that_fit(
    costs: Sequence[GroupCost],
    budget_bytes: int,
    num_sequences: int,
    block_size: int,
    max_context_tokens: int | None,
    *,
    hybrid: bool,
) -> Fit:
    """Largest context per sequence whose :func:`memory_needed` stays within ``budget_bytes``.

    Windows and chunks cap what their layers hold, so a model whose token layers are all
    bounded fits any context; the model's ``max_context_tokens`` then is the answer, and without
    one the context is unbounded.
    """
    ceiling = max_context_tokens if max_context_tokens is not None else _UNBOUNDED_TOKENS

    def fits(tokens: int) -> bool:
        return memory_needed(costs, tokens, num_sequences, block_size, hybrid=hybrid) <= budget_bytes

    if fits(ceiling):
        if max_context_tokens is None:
            return Fit(tokens_per_sequence=None, limited_by="unbounded")
        return Fit(tokens_per_sequence=ceiling, limited_by="max_position_embeddings")
    low, high = 0, ceiling  # fits(low) may be False when even the states do not fit
    if not fits(0):
        return Fit(tokens_per_sequence=0, limited_by="memory")
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return Fit(tokens_per_sequence=low, limited_by="memory")
