"""What one part is: a kvgroups layer cache read from a transformers cache layer, and which of its tensors.

:mod:`.cache_parts` reads a cache's layers as parts and puts them back; :mod:`.compressed_parts` does so for
DeepSeek-V4's compressed layers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.layouts import KVLayout


class PartRole(enum.Enum):
    """Which tensors of a transformers cache layer a part is."""

    KV = "kv"  # keys and values of one width: a (k, v) pair
    KEYS = "keys"  # MLA: the compressed latent (keys of their own width)
    VALUES = "values"  # MLA: the rotated rope key, kept as the layer's values
    INDEXER = "indexer"  # a sparse-attention indexer's keys
    INDEXER_POSITIONS = "indexer_positions"  # the positions an indexer ropes its keys by (Qwen4's 3D positions)
    CONV = "conv"  # conv state ``state_index`` of a linear-attention layer
    STATE = "state"  # recurrent state ``state_index`` of a linear-attention layer
    SHARED_KV = "shared_kv"  # keys that are the values too (DeepSeek-V4's window): stored once
    COMPRESSED = "compressed"  # a compressor's rows, one per window of tokens
    BUFFER_KV = "buffer_kv"  # a compressor's partial window at the boundary: its projections
    BUFFER_GATE = "buffer_gate"  # ... and their gates
    OVERLAP_KV = "overlap_kv"  # CSA: the last complete window's first series, for the next window
    OVERLAP_GATE = "overlap_gate"


@dataclass(frozen=True)
class Part:
    """One kvgroups layer cache read from transformers cache layer ``layer_index``.

    ``shape`` is the per-token row shape for token parts (``(heads, head_dim)`` for a K/V pair,
    ``(1, width)`` for a latent), the state shape for recurrent parts; ``value_head_dim`` is a
    pair's values' head size where it differs from the keys'. ``state_index`` tells the states of
    one linear-attention layer apart.
    """

    layer_index: int
    role: PartRole
    spec: LayerCacheSpec
    layout: KVLayout | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    state_index: int = 0
    value_head_dim: int | None = None
    stream: str = ""  # which compressor of a DeepSeek-V4 layer ("compressor", "indexer")

    @property
    def name(self) -> str:
        suffix = str(self.state_index) if self.role in (PartRole.CONV, PartRole.STATE) else ""
        stream = f".{self.stream}" if self.stream else ""
        return f"layers.{self.layer_index}.{self.role.value}{suffix}{stream}"

    @property
    def token_indexed(self) -> bool:
        return self.spec.token_indexed
