"""DeepSeek-V4's compressed-attention cache layers (``DeepseekV4HCACache``, ``DeepseekV4CSACache``) as parts.

Such a layer keeps, besides its window of one K=V head (``keys``; ``values`` is the same tensor), per
compressor (``"compressor"``; a CSA layer's indexer ``"indexer"`` too):

- ``compressed_kv``: one row per ``compress_rate`` tokens the sequence completed (``CompressedRows``);
- ``buffer_kv`` / ``buffer_gate``: the projections and gates of the tokens since the last complete window
  (``boundary % compress_rate`` of them): state at the boundary, held padded to ``compress_rate`` rows;
- CSA's ``overlap_kv`` / ``overlap_gate``: the last complete window's first series, which the next window
  reads (none before the first window completes); its gate in the compressor's ``position_bias`` dtype
  (float32 under a bfloat16 model);
- ``entry_count``: the rows so far, ``boundary // compress_rate``.

A restored layer holds exactly what computing the prefix leaves, so the compressor continues at any
boundary: one whose chunk size is no multiple of a ratio completes its window from the restored buffer.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvgroups.core.cache_specs import RecurrentState, SlidingWindow
from kvgroups.core.layouts import KVLayout
from kvgroups.core.row_specs import CompressedRows
from kvgroups.errors import UnsupportedCacheError
from kvgroups.integrations.transformers.parts import Part, PartRole

# Where transformers defines them. Looked up, never imported: a model's cache holds them only once its model's
# module was imported, and importing a model's module changes what transformers does for others.
_MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"
_CLASSES = ("DeepseekV4HCACache", "DeepseekV4CSACache")


def compressed_layer_classes() -> tuple[type, ...]:
    """The compressed layer classes of the transformers imported, where its DeepSeek-V4 module was loaded."""
    module = sys.modules.get(_MODULE)
    return tuple(getattr(module, name) for name in _CLASSES if hasattr(module, name)) if module else ()


def is_compressed_layer(layer: Any) -> bool:
    return type(layer) in compressed_layer_classes()

_BOUNDARY_STATES = ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")


def _gate_dtype(model: Any, layer_index: int, stream: str, gate: torch.Tensor) -> torch.dtype:
    """The dtype of an overlap gate: the gates plus the compressor's ``position_bias`` (as the model adds them)."""
    path = f"model.layers.{layer_index}.self_attn.compressor" + (".indexer" if stream == "indexer" else "")
    parameters = dict(model.named_parameters()) if model is not None else {}
    bias = parameters.get(f"{path}.position_bias")
    if bias is None:
        raise UnsupportedCacheError(f"cache layer {layer_index}: no {path}.position_bias in the model, whose dtype "
                                    f"the {stream}'s overlap gate takes")
    return torch.promote_types(gate.dtype, bias.dtype)


def compressed_parts(index: int, layer: Any, model: Any) -> list[Part]:
    """The parts of a compressed layer after a forward."""
    keys = layer.keys
    if keys is None or keys.dim() != 4 or keys.shape[:2] != (1, 1) or layer.values is not keys:
        raise UnsupportedCacheError(f"cache layer {index} ({type(layer).__name__}) holds keys of shape "
                                    f"{None if keys is None else list(keys.shape)}; expected [1, 1, seq, dim] shared "
                                    f"with its values")
    window = SlidingWindow(window_tokens=int(layer.sliding_window) - 1)
    parts = [Part(index, PartRole.SHARED_KV, window, KVLayout.MLA, keys.dtype, (1, keys.shape[3]))]
    rate = int(layer.compress_rate)
    overlaps = hasattr(layer, "overlap_kv")
    for stream, rows in layer.compressed_kv.items():
        buffer_kv, buffer_gate = layer.buffer_kv[stream], layer.buffer_gate[stream]
        if rows is None or buffer_kv is None or buffer_gate is None or rows.shape[0] != 1:
            raise UnsupportedCacheError(f"cache layer {index} holds no {stream} state of batch 1 after a forward")
        parts.append(Part(index, PartRole.COMPRESSED, CompressedRows(tokens_per_row=rate), KVLayout.MLA, rows.dtype,
                          (1, rows.shape[-1]), stream=stream))
        width = int(buffer_kv.shape[-1])
        states = [(PartRole.BUFFER_KV, buffer_kv.dtype, width), (PartRole.BUFFER_GATE, buffer_gate.dtype, width)]
        if overlaps:  # the first series: half the buffer's width
            states += [(PartRole.OVERLAP_KV, buffer_kv.dtype, width // 2),
                       (PartRole.OVERLAP_GATE, _gate_dtype(model, index, stream, buffer_gate), width // 2)]
        parts += [Part(index, role, RecurrentState(state_shapes=((rate, size),)), None, dtype, (rate, size),
                       stream=stream) for role, dtype, size in states]
    return parts


def compressed_value(part: Part, layer: Any) -> Any:
    """The part's tensor in ``layer``: the window and rows as views; a boundary state as a padded copy
    ``[1, compress_rate, width]`` (a partial window, or no overlap yet, padded with zeros)."""
    if part.role is PartRole.SHARED_KV:
        return layer.keys[0]  # [1, 1, seq, dim] -> [num_blocks=1, seq, dim]
    if part.role is PartRole.COMPRESSED:
        return layer.compressed_kv[part.stream]
    held = getattr(layer, part.role.value)[part.stream]
    padded = torch.zeros((1, *part.shape), dtype=part.dtype, device=layer.keys.device)
    if held is not None:
        padded[:, : held.shape[1]] = held
    return padded


def install_compressed(parts: Sequence[Part], values: Mapping[str, Any], layer: Any, boundary: int) -> None:
    """Put a compressed layer's restored parts into its fresh layer, as computing ``boundary`` tokens leaves it."""
    rate = int(layer.compress_rate)
    rows, partial = divmod(boundary, rate)
    for part in parts:
        value = values[part.name]
        if part.role is PartRole.SHARED_KV:
            keys = value.unsqueeze(0)
            layer.update(keys, keys)
        elif part.role is PartRole.COMPRESSED:
            layer.compressed_kv[part.stream] = value[:, :rows]
            layer.entry_count[part.stream] = rows
        elif part.role.value in ("buffer_kv", "buffer_gate"):
            getattr(layer, part.role.value)[part.stream] = value[:, :partial]
        else:  # an overlap exists once a window completed
            getattr(layer, part.role.value)[part.stream] = value if rows else None
