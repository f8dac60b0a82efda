"""Attention families whose sliding and full layers differ in KV heads and head sizes (Gemma 4,
MiMo-V2-Flash's ``hybrid_layer_pattern`` with ``swa_*`` fields), and mllama's cross-attention
layers, which cache image tokens rather than text tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvgroups.core.cache_specs import FullAttention, LayerCacheSpec, SlidingWindow
from kvgroups.core.checks import is_int_at_least
from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family
from kvgroups.models.layers import AttentionLayer, CrossAttentionLayer, ModelLayer, NoCacheLayer


def _layer_type_list(config: ConfigFields, default: list[str]) -> list[str]:
    layer_types: Any = config.data.get("layer_types")
    num_layers = config.integer("num_hidden_layers")
    if layer_types is None:
        return default
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelConfigError(f"layer_types must list {num_layers} entries, got {layer_types!r}")
    unknown = sorted({str(kind) for kind in layer_types if kind not in ("sliding_attention", "full_attention")})
    if unknown:
        raise ModelConfigError(f"layer_types entries {unknown} are not supported for model_type "
                               f"{config.model_type!r}; expected sliding_attention or full_attention")
    return list(layer_types)


_GEMMA4 = {"head_dim": 256, "global_head_dim": 512, "sliding_window": 512, "num_key_value_heads": 4,
           "num_attention_heads": 8, "num_hidden_layers": 30, "max_position_embeddings": 131072,
           "num_kv_shared_layers": 0}
_GEMMA4_READS = ("global_head_dim", "num_global_key_value_heads", "num_kv_shared_layers")


@family("gemma4", "gemma4_text", defaults=_GEMMA4, reads_layer_types=False, reads=_GEMMA4_READS)
def _gemma4(config: ConfigFields) -> list[ModelLayer]:
    """Sliding layers: ``num_key_value_heads`` x ``head_dim``; full layers: ``global_head_dim``, with
    ``num_global_key_value_heads`` where ``attention_k_eq_v`` (keys and values are still both cached);
    the last ``num_kv_shared_layers`` layers reuse an earlier layer's cache. Without ``layer_types``
    every 6th layer is full, and the last layer is always full (transformers forces it). A config
    transformers saved carries the full layers' sizes in ``per_layer_config`` instead, which wins.
    Gemma 4 Unified's text model is built the same way."""
    if config.get("use_bidirectional_attention") == "all":
        raise ModelConfigError("gemma4 with use_bidirectional_attention 'all' is not a causal decoder with a KV cache")
    num_layers = config.integer("num_hidden_layers")
    layer_types = _layer_type_list(
        config, ["sliding_attention" if (index + 1) % 6 else "full_attention" for index in range(num_layers)]
    )
    if layer_types[-1] != "full_attention":
        config.warn(f"layer_types ends in {layer_types[-1]!r}; the last layer is read as full_attention, as "
                    f"transformers forces it")
        layer_types[-1] = "full_attention"
    window = config.sliding_window()
    sliding = AttentionLayer(spec=SlidingWindow(window_tokens=window) if window else FullAttention(),
                             num_kv_heads=config.num_kv_heads(), head_size=config.head_size())
    global_heads = config.num_kv_heads()
    if config.get("attention_k_eq_v") is True and config.get("num_global_key_value_heads") is not None:
        global_heads = config.integer("num_global_key_value_heads")
    full = AttentionLayer(spec=FullAttention(), num_kv_heads=global_heads, head_size=config.integer("global_head_dim"))
    shared = config.integer("num_kv_shared_layers", minimum=0)
    if shared > num_layers:
        raise ModelConfigError(f"num_kv_shared_layers={shared} exceeds num_hidden_layers={num_layers}")
    return [
        NoCacheLayer(reason="shares an earlier layer's KV") if index >= num_layers - shared
        else full if kind == "full_attention" else sliding
        for index, kind in enumerate(layer_types)
    ]


family("gemma4_unified", "gemma4_unified_text", reads_layer_types=False, reads=_GEMMA4_READS,
       defaults={**_GEMMA4, "sliding_window": 1024, "max_position_embeddings": 262144})(_gemma4)


@family("gemma3n", "gemma3n_text", defaults={
    "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
    "sliding_window": 512, "max_position_embeddings": 32768, "num_kv_shared_layers": 15,
}, reads_layer_types=False, reads=("num_kv_shared_layers",))
def _gemma3n(config: ConfigFields) -> list[ModelLayer]:
    """``layer_types`` (else every 5th layer full, the others sliding); the last ``num_kv_shared_layers``
    layers reuse the cache of the last earlier layer of their kind and keep none of their own."""
    num_layers = config.integer("num_hidden_layers")
    layer_types = _layer_type_list(
        config, ["full_attention" if (index + 1) % 5 == 0 else "sliding_attention" for index in range(num_layers)])
    shared = config.integer("num_kv_shared_layers", minimum=0)
    if shared >= num_layers:
        raise ModelConfigError(f"num_kv_shared_layers={shared} leaves no layer of the {num_layers} keeping a cache")
    window = config.sliding_window()
    kinds = {"full_attention": config.attention(FullAttention()),
             "sliding_attention": config.attention(SlidingWindow(window_tokens=window) if window else FullAttention())}
    return [NoCacheLayer(reason="shares an earlier layer's KV") if index >= num_layers - shared else kinds[kind]
            for index, kind in enumerate(layer_types)]


# MiMo-V2-Flash's published configs carry attention_chunk_size beside sliding_window_size (the same
# number); neither vLLM's model nor transformers' reads it: sliding layers slide, they do not chunk.
_SWA_FIELDS = ("hybrid_layer_pattern", "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
               "swa_v_head_dim", "swa_rope_theta", "v_head_dim", "attention_chunk_size")


def _pattern(config: ConfigFields, num_layers: int) -> list[str]:
    pattern = config.int_list("hybrid_layer_pattern")
    if pattern is None:  # transformers' default: full at layer 0 and every 6th layer
        return _layer_type_list(config, ["full_attention" if index == 0 or (index + 1) % 6 == 0
                                         else "sliding_attention" for index in range(num_layers)])
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise ModelConfigError(
            f"hybrid_layer_pattern must hold {num_layers} entries of 0 (full) or 1 (sliding), got {pattern!r}"
        )
    return ["sliding_attention" if kind else "full_attention" for kind in pattern]


def _attention(config: ConfigFields, spec: LayerCacheSpec, prefix: str) -> AttentionLayer:
    """One attention kind's layer from its fields (``swa_`` prefix for the sliding ones), as vLLM reads them."""
    heads_field, head_field = f"{prefix}num_key_value_heads", f"{prefix}head_dim"
    config.require(heads_field, head_field)
    head = config.integer(head_field)
    value = config.integer(f"{prefix}v_head_dim") if config.get(f"{prefix}v_head_dim") is not None else head
    return AttentionLayer(spec=spec, num_kv_heads=config.integer(heads_field), head_size=head,
                          value_head_size=None if value == head else value)


@family("mimo_v2_flash", defaults={"head_dim": 192, "v_head_dim": 128, "num_key_value_heads": 4,
                                   "num_attention_heads": 64, "num_hidden_layers": 48, "sliding_window": 129,
                                   "max_position_embeddings": 131072},
        reads_layer_types=False, reads=_SWA_FIELDS)
def _mimo_v2_flash(config: ConfigFields) -> list[ModelLayer]:
    """``hybrid_layer_pattern`` (0 full, 1 sliding): full layers use ``num_key_value_heads`` /
    ``head_dim`` / ``v_head_dim``, sliding ones the ``swa_`` fields and a window of
    ``sliding_window_size`` (else ``sliding_window``) tokens, as vLLM builds them. A config that
    transformers saved has neither the pattern nor the ``swa_`` fields but ``layer_types``: its model
    gives sliding layers twice ``num_key_value_heads`` and the full layers' head sizes, over
    ``sliding_window`` (transformers' own: ``sliding_window_size + 1``)."""
    num_layers = config.integer("num_hidden_layers")
    if config.get("hybrid_layer_pattern") is None and not any(
            config.data.get(name) is not None for name in _SWA_FIELDS if name.startswith("swa_")):
        return _mimo_as_transformers(config, num_layers)
    layer_types = _pattern(config, num_layers)
    window_field = "sliding_window_size" if config.get("sliding_window_size") is not None else "sliding_window"
    kinds = {"full_attention": _attention(config, FullAttention(), "")}
    if "sliding_attention" in layer_types:
        window = config.integer(window_field)
        kinds["sliding_attention"] = _attention(config, SlidingWindow(window_tokens=window), "swa_")
    return [kinds[kind] for kind in layer_types]


def _mimo_as_transformers(config: ConfigFields, num_layers: int) -> list[ModelLayer]:
    layer_types = _layer_type_list(config, ["full_attention" if index == 0 or (index + 1) % 6 == 0
                                            else "sliding_attention" for index in range(num_layers)])
    full = _attention(config, FullAttention(), "")
    sliding = dataclasses.replace(full, spec=SlidingWindow(window_tokens=config.integer("sliding_window")),
                                  num_kv_heads=2 * full.num_kv_heads)
    return [full if kind == "full_attention" else sliding for kind in layer_types]


def _tokens_per_image(config: ConfigFields) -> int:
    """Vision tokens one image leaves in each cross-attention layer: every tile of ``max_num_tiles``
    (padding tiles included) holds ``(image_size / patch_size)^2 + 1`` patches (the class token)."""
    vision = config.outer.get("vision_config")
    vision = vision if isinstance(vision, dict) else {}
    sizes = {name: vision.get(name, default) for name, default in
             (("image_size", 448), ("patch_size", 14), ("max_num_tiles", 4))}  # transformers' defaults
    for name, value in sizes.items():
        if not is_int_at_least(value, 1):
            raise ModelConfigError(f"vision_config.{name} must be a positive int, got {value!r}")
    tiles, image, patch = (int(sizes[name]) for name in ("max_num_tiles", "image_size", "patch_size"))
    return tiles * ((image // patch) ** 2 + 1)


@family("mllama", "mllama_text_model", defaults={
    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
    "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38], "max_position_embeddings": 131072,
}, reads_layer_types=False, reads=("cross_attention_layers",))
def _mllama(config: ConfigFields) -> list[ModelLayer]:
    """Self-attention layers cache text tokens; the ``cross_attention_layers`` (counted in
    num_hidden_layers) cache the keys and values of every image's vision tokens instead."""
    cross = config.layer_indices("cross_attention_layers")
    self_attention = config.attention(FullAttention())
    image = CrossAttentionLayer(num_kv_heads=self_attention.num_kv_heads, head_size=self_attention.head_size,
                                tokens_per_image=_tokens_per_image(config))
    return [image if index in cross else self_attention for index in range(config.integer("num_hidden_layers"))]
