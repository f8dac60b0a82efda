"""The KV-cache kinds of vLLM 0.32-0.34 the connector refuses, each with the reason, by spec class.

Every kind vLLM defines for a model in its registry is either planned by
:func:`~kvgroups.integrations.vllm.engine_groups.layer_plan` (full, sliding-window, chunked-local and MLA
attention, mamba states; DeepSeek-V4's packed pages, :mod:`.packed_pages`) or refused here, naming the kind
and why, rather than served as a hit that could not be restored. Looked up by class name: a class a
release lacks is never met there.
"""

from __future__ import annotations

from typing import Any

REASONS: dict[str, str] = {
    "CircularBufferSpec": "a ring of one block per request (DeepSeek-V4.1's compressor) that vLLM overwrites in place "
                          "and never prefix-caches: no stored prefix can say what it holds at a boundary",
    "RSWASpec": "reference sliding-window attention evicts generated tokens that left its window while prompt tokens "
                "stay: what a block holds depends on when its tokens were generated, not on their positions",
    "SinkFullAttentionSpec": "attention sinks (sink_len) kept by its backend beside the block table's pages: a "
                             "restore of the pages alone was never checked to continue as computing does",
    "HiddenStateCacheSpec": "hidden states kept for extract_hidden_states (a drafter's input), not the KV a prefix "
                            "computes",
    "HiSparseHotSpec": "HiSparse's per-request hot pages (never prefix-cached): the KV they cache lives in host "
                       "memory under HiSparse's control",
    "HiSparseResidentSpec": "HiSparse's reclaimable resident pages (never prefix-cached): the KV they cache lives in "
                            "host memory under HiSparse's control",
    "CrossAttentionSpec": "the encoder's keys and values of an encoder-decoder model: computed from its inputs, "
                          "not from the prompt's tokens",
}


def refusal(spec: Any) -> str | None:
    """Why the connector refuses ``spec``'s kind, or None for a kind it may plan."""
    return REASONS.get(type(spec).__name__)
