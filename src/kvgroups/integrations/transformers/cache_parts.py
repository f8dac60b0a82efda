"""A transformers cache, layer by layer, as kvgroups layer caches ("parts"), and back.

transformers 5.x keeps one layer object per model layer in a ``DynamicCache``. Each is read as one
or more parts, each a kvgroups layer cache that the grouping, the data path and the chunk store
handle like any engine's:

- an attention layer's keys and values ``[1, heads, seq, head_dim]``: a ``(k, v)`` pair in
  ``KV_SPLIT_HND`` with one block of ``seq`` tokens; full attention, or a sliding window of what
  the layer keeps (``sliding_window - 1`` tokens, transformers' own rule);
- keys and values of different widths (MLA keeps the compressed latent and the rotated rope key):
  two ``MLA``-layout parts ``[1, seq, width]``; the indexer keys of sparse attention one more;
- each conv and recurrent state of a linear-attention layer (mamba, gated DeltaNet, short conv):
  a ``RecurrentState`` part ``[1, *shape]``, kept exactly as transformers holds it (conv states
  keep all ``kernel`` columns: trimming to ``kernel - 1`` is not right for every model).

Which tokens a part holds, and how a part is put back into a fresh layer, is decided here once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from kvgroups.core.cache_specs import FullAttention, LayerCacheSpec, MLAttention, RecurrentState, SlidingWindow
from kvgroups.core.layouts import KVLayout
from kvgroups.errors import UnsupportedCacheError


@dataclass(frozen=True)
class Part:
    """One kvgroups layer cache read from transformers cache layer ``layer_index``.

    ``role`` is ``kv`` (a K/V pair), ``keys`` / ``values`` (MLA latents), ``indexer``, or
    ``conv{j}`` / ``state{j}`` (state ``j`` of a linear-attention layer). ``kept_tokens`` is how
    many tokens a sliding layer holds (None: every token); ``shape`` the per-token row shape for
    token parts, the state shape for recurrent parts.
    """

    layer_index: int
    role: str
    spec: LayerCacheSpec
    layout: KVLayout | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    kept_tokens: int | None = None

    @property
    def name(self) -> str:
        return f"layers.{self.layer_index}.{self.role}"

    @property
    def token_indexed(self) -> bool:
        return self.spec.token_indexed


def _attention_parts(index: int, layer: Any) -> list[Part]:
    keys, values = layer.keys, layer.values
    if keys is None or keys.dim() != 4 or keys.shape[0] != 1:
        raise UnsupportedCacheError(f"cache layer {index} ({type(layer).__name__}) holds keys of shape "
                                    f"{None if keys is None else list(keys.shape)}; expected [1, heads, seq, dim]")
    kept = None
    spec: LayerCacheSpec = FullAttention()
    if isinstance(layer, DynamicSlidingWindowLayer):
        kept = int(layer.sliding_window) - 1  # transformers keeps the window less the token being computed
        spec = SlidingWindow(window_tokens=kept)
    if keys.shape[1] == values.shape[1] and keys.shape[3] == values.shape[3] and keys.dtype == values.dtype:
        return [Part(index, "kv", spec, KVLayout.KV_SPLIT_HND, keys.dtype, (keys.shape[1], keys.shape[3]), kept)]
    if keys.shape[1] != 1 or values.shape[1] != 1 or kept is not None:
        raise UnsupportedCacheError(
            f"cache layer {index} holds keys {list(keys.shape)} and values {list(values.shape)} of different "
            f"widths with several heads or a window; only single-head latents (MLA) are supported"
        )
    return [Part(index, "keys", MLAttention(), KVLayout.MLA, keys.dtype, (1, keys.shape[3])),
            Part(index, "values", MLAttention(), KVLayout.MLA, values.dtype, (1, values.shape[3]))]


def describe(cache: Any) -> list[Part]:
    """The parts of a cache after at least one forward (so every layer holds tensors)."""
    parts: list[Part] = []
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            continue
        known = isinstance(layer, (CacheLayerMixin, LinearAttentionCacheLayerMixin))
        if not known:
            raise UnsupportedCacheError(f"cache layer {index} is a {type(layer).__name__}, which kvgroups cannot store")
        if isinstance(layer, CacheLayerMixin):
            parts += _attention_parts(index, layer)
        if isinstance(layer, DynamicIndexedLayer) and layer.indexer_keys is not None:
            indexer = layer.indexer_keys
            if getattr(layer, "indexer_position_ids", None) is not None:
                raise UnsupportedCacheError(f"cache layer {index} keeps indexer position ids, which kvgroups "
                                            f"cannot store")
            parts.append(Part(index, "indexer", MLAttention(), KVLayout.MLA, indexer.dtype, (1, indexer.shape[-1])))
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if layer.record_past:
                raise UnsupportedCacheError(f"cache layer {index} records past states (speculative decoding)")
            for state in range(layer.number_of_states):
                for role, tensors in ((f"conv{state}", layer.conv_states), (f"state{state}", layer.recurrent_states)):
                    tensor = tensors[state]
                    if tensor is None:
                        continue
                    if tensor.shape[0] != 1:
                        raise UnsupportedCacheError(f"cache layer {index} holds a state of batch {tensor.shape[0]}")
                    shape = tuple(int(dim) for dim in tensor.shape[1:])
                    parts.append(Part(index, role, RecurrentState(state_shapes=(shape,)), None, tensor.dtype, shape))
    if not parts:
        raise UnsupportedCacheError("the model's cache holds nothing to store")
    return parts


def current_value(part: Part, cache: Any) -> Any:
    """The part's tensors in ``cache``, as the kvgroups layer cache (views, never copies)."""
    layer = cache.layers[part.layer_index]
    if part.role == "kv":
        return (layer.keys, layer.values)
    if part.role in ("keys", "values"):
        return getattr(layer, part.role)[0]  # [1, 1, seq, width] -> [num_blocks=1, seq, width]
    if part.role == "indexer":
        return layer.indexer_keys
    state = int(part.role[4:]) if part.role.startswith("conv") else int(part.role[5:])
    return (layer.conv_states if part.role.startswith("conv") else layer.recurrent_states)[state]


def empty_value(part: Part, num_tokens: int, device: torch.device) -> Any:
    """Fresh tensors for a part holding ``num_tokens`` tokens (or one state), to unpack into."""
    if not part.token_indexed:
        return torch.empty((1, *part.shape), dtype=part.dtype, device=device)
    if part.role == "kv":
        heads, head_dim = part.shape
        return tuple(torch.empty(1, heads, num_tokens, head_dim, dtype=part.dtype, device=device) for _ in range(2))
    return torch.empty(1, num_tokens, part.shape[1], dtype=part.dtype, device=device)


def install(parts: Sequence[Part], values: Mapping[str, Any], cache: Any, boundary: int) -> None:
    """Put restored part values into a fresh cache, as if ``boundary`` tokens had been computed."""
    by_layer: dict[int, dict[str, Any]] = {}
    for part in parts:
        by_layer.setdefault(part.layer_index, {})[part.role] = values[part.name]
    for index, roles in by_layer.items():
        layer = cache.layers[index]
        if "kv" in roles:
            layer.update(*roles["kv"])
        if "keys" in roles:
            layer.update(roles["keys"].unsqueeze(0), roles["values"].unsqueeze(0))
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = boundary  # update() counted only the tokens restored
        if "indexer" in roles:
            layer.update_indexer(roles["indexer"])
        # Conv states first: the first update_conv_state of a fresh layer takes them as a prefill's
        # (and marks the state as present); marking it present before would make it append instead.
        for role, tensor in roles.items():
            if role.startswith("conv"):
                state = int(role[4:])
                layer.update_conv_state(tensor, state_idx=state, conv_kernel_size=tensor.shape[-1])
        for role, tensor in roles.items():
            if role.startswith("state"):
                state = int(role[5:])
                layer.update_recurrent_state(tensor, state_idx=state)
                layer.has_previous_state[state] = True
