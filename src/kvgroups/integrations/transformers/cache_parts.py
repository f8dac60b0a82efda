"""A transformers cache, layer by layer, as kvgroups layer caches ("parts"), and back.

transformers 5.x keeps one layer object per model layer in a ``DynamicCache``. Each is read as one
or more parts, each a kvgroups layer cache that the grouping, the data path and the chunk store
handle like any engine's:

- an attention layer's keys and values ``[1, heads, seq, head_dim]``: a ``(k, v)`` pair in
  ``KV_SPLIT_HND`` with one block of ``seq`` tokens; full attention, or a sliding window of what
  the layer keeps (``sliding_window - 1`` tokens, transformers' own rule); values may have a head
  size of their own (MiMo-V2-Flash's 192 / 128), held unpadded in the pair;
- single-head keys and values of different widths in full attention (MLA keeps the compressed
  latent and the rotated rope key): two ``MLA``-layout parts ``[1, seq, width]``; the indexer
  keys of sparse attention one more, and where the indexer ropes them by positions of their own
  (Qwen4's three rotary axes, ``[3, 1, seq]`` int64) those too, as rows of 3 int64 a token;
- each conv and recurrent state of a linear-attention layer (mamba, gated DeltaNet, short conv):
  a ``RecurrentState`` part ``[1, *shape]``, kept exactly as transformers holds it (conv states
  keep all ``kernel`` columns: trimming to ``kernel - 1`` is not right for every model);
- a DeepSeek-V4 compressed layer (:mod:`.compressed_parts`): its window of one K=V head, once; per
  compressor (the attention's, a CSA layer's indexer's) its compressed rows as ``CompressedRows`` and
  its state at the boundary (the partial window's projections and gates, CSA's overlap) as states.

Which tensors a part is in a cache, and how a part is put back into a fresh layer, is decided here once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from kvgroups.core.cache_specs import FullAttention, LayerCacheSpec, MLAttention, RecurrentState, SlidingWindow
from kvgroups.core.layouts import KVLayout
from kvgroups.errors import UnsupportedCacheError
from kvgroups.integrations.transformers.compressed_parts import (
    compressed_layer_classes,
    compressed_parts,
    compressed_value,
    install_compressed,
    is_compressed_layer,
)
from kvgroups.integrations.transformers.parts import Part, PartRole
from kvgroups.integrations.transformers.reserved_layers import ReservedDynamicLayer

__all__ = ["KNOWN_LAYERS", "Part", "PartRole", "current_value", "empty_value", "install", "read_parts"]


def _attention_parts(index: int, layer: Any) -> list[Part]:
    keys, values = layer.keys, layer.values
    if keys is None or keys.dim() != 4 or keys.shape[0] != 1:
        raise UnsupportedCacheError(f"cache layer {index} ({type(layer).__name__}) holds keys of shape "
                                    f"{None if keys is None else list(keys.shape)}; expected [1, heads, seq, dim]")
    sliding = isinstance(layer, DynamicSlidingWindowLayer)
    # transformers keeps the window less the token being computed.
    spec: LayerCacheSpec = SlidingWindow(window_tokens=int(layer.sliding_window) - 1) if sliding else FullAttention()
    if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise UnsupportedCacheError(
            f"cache layer {index} holds keys {list(keys.shape)} {keys.dtype} and values {list(values.shape)} "
            f"{values.dtype}; expected one head count, length and dtype"
        )
    latent = keys.shape[1] == 1 and keys.shape[3] != values.shape[3]
    if not latent:  # keys and values per head, of one head size or each of its own
        value_head_dim = None if keys.shape[3] == values.shape[3] else int(values.shape[3])
        return [Part(index, PartRole.KV, spec, KVLayout.KV_SPLIT_HND, keys.dtype, (keys.shape[1], keys.shape[3]),
                     value_head_dim=value_head_dim)]
    # An MLA latent (and its rope key, kept as the values), in every token or in a window (dots3's sliding layers).
    latent_spec: LayerCacheSpec = spec if sliding else MLAttention()
    return [Part(index, PartRole.KEYS, latent_spec, KVLayout.MLA, keys.dtype, (1, keys.shape[3])),
            Part(index, PartRole.VALUES, latent_spec, KVLayout.MLA, values.dtype, (1, values.shape[3]))]


def _state_parts(index: int, layer: Any) -> list[Part]:
    if layer.record_past:
        raise UnsupportedCacheError(f"cache layer {index} records past states (speculative decoding)")
    parts = []
    for state in range(layer.number_of_states):
        for role, tensors in ((PartRole.CONV, layer.conv_states), (PartRole.STATE, layer.recurrent_states)):
            tensor = tensors[state]
            if tensor is None:
                continue
            if tensor.shape[0] != 1:
                raise UnsupportedCacheError(f"cache layer {index} holds a state of batch {tensor.shape[0]}")
            shape = tuple(int(dim) for dim in tensor.shape[1:])
            parts.append(Part(index, role, RecurrentState(state_shapes=(shape,)), None, tensor.dtype, shape, state))
    return parts


# The layer classes whose every tensor is read and restored here. A subclass may keep more (DeepSeek-V4's
# compressor state, MiniMax-M3's block index keys), so classes are matched exactly.
KNOWN_LAYERS = (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer, LinearAttentionLayer,
                LinearAttentionAndFullAttentionLayer, LinearAttentionAndSlidingWindowAttentionLayer,
                ReservedDynamicLayer)


def _check_layer(index: int, layer: Any) -> None:
    known_layers = (*KNOWN_LAYERS, *compressed_layer_classes())
    if type(layer) in known_layers:
        return
    known = next((base.__name__ for base in type(layer).__mro__[1:] if base in known_layers), None)
    kept = f" (a {known} that keeps state of its own)" if known else ""
    raise UnsupportedCacheError(f"cache layer {index} is a {type(layer).__name__}{kept}, which kvgroups cannot store; "
                                f"expected one of {', '.join(cls.__name__ for cls in known_layers)}")


def _holds_state(layer: Any) -> bool:
    return any(tensors.get(state) is not None for tensors in (layer.conv_states, layer.recurrent_states)
               for state in range(layer.number_of_states))


def read_parts(cache: Any, model: Any = None) -> list[Part]:
    """The parts of a cache after at least one forward (``model``: the one that wrote it, where a part's dtype
    is its parameters' before the forward writes it: DeepSeek-V4's overlap gates).

    A layer the forward left empty (mllama's cross-attention layers, written only for images) holds
    nothing of the text and is skipped, as a fresh cache leaves it empty too; a linear-attention layer
    left without any state is refused: its model keeps the state somewhere else.
    """
    parts: list[Part] = []
    for index, layer in enumerate(cache.layers):
        _check_layer(index, layer)
        if isinstance(layer, DummyLayer):
            continue
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not _holds_state(layer):
            raise UnsupportedCacheError(f"cache layer {index} ({type(layer).__name__}) holds no state after a "
                                        f"forward: the model keeps its recurrent state outside the cache")
        if is_compressed_layer(layer):
            parts += compressed_parts(index, layer, model)
        elif isinstance(layer, CacheLayerMixin) and layer.keys is not None:
            parts += _attention_parts(index, layer)
        if isinstance(layer, DynamicIndexedLayer) and layer.indexer_keys is not None:
            indexer = layer.indexer_keys
            parts.append(Part(index, PartRole.INDEXER, MLAttention(), KVLayout.MLA, indexer.dtype,
                              (1, indexer.shape[-1])))
        positions = getattr(layer, "indexer_position_ids", None)
        if isinstance(layer, DynamicIndexedLayer) and positions is not None:
            if positions.dim() != 3 or positions.shape[1] != 1:
                raise UnsupportedCacheError(f"cache layer {index} keeps indexer position ids of shape "
                                            f"{list(positions.shape)}; expected [axes, 1, seq]")
            parts.append(Part(index, PartRole.INDEXER_POSITIONS, MLAttention(), KVLayout.MLA, positions.dtype,
                              (1, positions.shape[0])))
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            parts += _state_parts(index, layer)
    if not parts:
        raise UnsupportedCacheError("the model's cache holds nothing to store")
    return parts


def current_value(part: Part, cache: Any) -> Any:
    """The part's tensors in ``cache``, as the kvgroups layer cache (views, never copies)."""
    layer = cache.layers[part.layer_index]
    if part.stream or part.role is PartRole.SHARED_KV:
        return compressed_value(part, layer)
    if part.role is PartRole.KV:
        return (layer.keys, layer.values)
    if part.role is PartRole.KEYS:
        return layer.keys[0]  # [1, 1, seq, width] -> [num_blocks=1, seq, width]
    if part.role is PartRole.VALUES:
        return layer.values[0]
    if part.role is PartRole.INDEXER:
        return layer.indexer_keys
    if part.role is PartRole.INDEXER_POSITIONS:
        # [axes, 1, seq] -> [1, seq, axes]: a copy (24 bytes a token), as the forward may leave it an expanded view
        return layer.indexer_position_ids.permute(1, 2, 0).contiguous()
    return (layer.conv_states if part.role is PartRole.CONV else layer.recurrent_states)[part.state_index]


def empty_value(part: Part, num_slots: int, device: torch.device) -> Any:
    """Fresh tensors for a part holding ``num_slots`` slots (tokens, compressed rows; or one state), to unpack into."""
    if not part.token_indexed:
        return torch.empty((1, *part.shape), dtype=part.dtype, device=device)
    if part.role is PartRole.KV:
        heads, head_dim = part.shape
        return tuple(torch.empty(1, heads, num_slots, size, dtype=part.dtype, device=device)
                     for size in (head_dim, part.value_head_dim or head_dim))
    return torch.empty(1, num_slots, part.shape[1], dtype=part.dtype, device=device)


def install(parts: Sequence[Part], values: Mapping[str, Any], cache: Any, boundary: int) -> None:
    """Put restored part values into a fresh cache, as if ``boundary`` tokens had been computed."""
    by_layer: dict[int, list[Part]] = {}
    for part in parts:
        by_layer.setdefault(part.layer_index, []).append(part)
    for index, layer_parts in by_layer.items():
        layer = cache.layers[index]
        if is_compressed_layer(layer):
            install_compressed(layer_parts, values, layer, boundary)
            _count_tokens(layer, boundary)
            continue
        by_role = {part.role: values[part.name] for part in layer_parts if part.token_indexed}
        if PartRole.KV in by_role:
            keys, values_ = by_role[PartRole.KV]
            if keys.shape[-2] > boundary:  # a DynamicLayer's, restored with room for what the next forward computes
                cache.layers[index] = ReservedDynamicLayer(keys, values_, boundary)
            else:  # every token restored, or a window of them
                layer.update(keys, values_)
        if PartRole.KEYS in by_role:
            layer.update(by_role[PartRole.KEYS].unsqueeze(0), by_role[PartRole.VALUES].unsqueeze(0))
        if PartRole.INDEXER in by_role:
            layer.update_indexer(by_role[PartRole.INDEXER])
        if PartRole.INDEXER_POSITIONS in by_role:
            layer.indexer_position_ids = by_role[PartRole.INDEXER_POSITIONS].permute(2, 0, 1).contiguous()
        # Conv states first: the first update_conv_state of a fresh layer takes them as a prefill's
        # (and marks the state as present); marking it present before would make it append instead.
        for part in layer_parts:
            if part.role is PartRole.CONV:
                tensor = values[part.name]
                layer.update_conv_state(tensor, state_idx=part.state_index, conv_kernel_size=tensor.shape[-1])
        for part in layer_parts:
            if part.role is PartRole.STATE:
                layer.update_recurrent_state(values[part.name], state_idx=part.state_index)
                layer.has_previous_state[part.state_index] = True
        _count_tokens(cache.layers[index], boundary)


# The token counts a layer keeps beside its tensors: a sliding layer's tokens seen (its updates counted only
# the window restored), and, from transformers 5.25, a linear-attention layer's (its update_conv_state
# counted the conv window restored). A counter left as the restore's updates set it tells the model a
# prefix of another length: positions and masks it derives from the cache then differ from computing.
TOKEN_COUNTERS = ("cumulative_length", "cumulative_length_linear")


def _count_tokens(layer: Any, boundary: int) -> None:
    """Set every token counter ``layer`` keeps to ``boundary``, in place where it is a tensor (transformers
    marks it as a static address) and as an int where it is one."""
    for name in TOKEN_COUNTERS:
        count = getattr(layer, name, None)
        if isinstance(count, torch.Tensor):
            count.fill_(boundary)
        elif isinstance(count, int):
            setattr(layer, name, boundary)
