"""Attention-only families: every layer keeps keys and values (full, sliding or chunked)."""

from __future__ import annotations

from collections.abc import Mapping

from kvgroups.core.cache_specs import FullAttention, LayerCacheSpec, SlidingWindow
from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import GENERIC_FIELDS, ConfigFields, family, from_layer_types
from kvgroups.models.layers import (
    AttentionLayer,
    ModelLayer,
    NoCacheLayer,
)


def uniform_layers(config: ConfigFields, first_sliding: int) -> list[ModelLayer]:
    """Every layer alike, sliding from layer ``first_sliding`` on where a window applies."""
    config.require(*GENERIC_FIELDS)
    window = config.sliding_window()
    return [
        config.attention(
            SlidingWindow(window_tokens=window) if window and index >= first_sliding else FullAttention()
        )
        for index in range(config.integer("num_hidden_layers"))
    ]


@family("llama", "mistral", "mixtral", "phi3")
def _llama_like(config: ConfigFields) -> list[ModelLayer]:
    """Every layer alike; all of them slide where a window applies."""
    return uniform_layers(config, first_sliding=0)


@family("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", reads=("max_window_layers",))
def _qwen(config: ConfigFields) -> list[ModelLayer]:
    """Every layer alike; the window applies from layer ``max_window_layers`` on."""
    first_sliding = 0
    if config.get("max_window_layers") is not None:
        first_sliding = config.integer("max_window_layers", minimum=0)
    return uniform_layers(config, first_sliding)


@family("gemma2", defaults={"head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 8192,
                             "num_key_value_heads": 4})
def _gemma2(config: ConfigFields) -> list[ModelLayer]:
    """Even layers slide, odd layers are global."""
    num_layers = config.integer("num_hidden_layers")
    return from_layer_types(
        config, ["sliding_attention" if (index + 1) % 2 else "full_attention" for index in range(num_layers)]
    )


@family("gemma3", "gemma3_text", defaults={"head_dim": 256, "sliding_window": 4096,
                                            "max_position_embeddings": 131072, "num_key_value_heads": 4,
                                            "num_hidden_layers": 26, "num_attention_heads": 8},
        reads=("sliding_window_pattern",))
def _gemma3(config: ConfigFields) -> list[ModelLayer]:
    """Every ``sliding_window_pattern``-th layer (default 6) is global, the rest slide."""
    pattern = config.integer("sliding_window_pattern") if config.get("sliding_window_pattern") else 6
    num_layers = config.integer("num_hidden_layers")
    return from_layer_types(
        config, ["sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(num_layers)]
    )


@family("gpt_oss", defaults={"head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072})
def _gpt_oss(config: ConfigFields) -> list[ModelLayer]:
    num_layers = config.integer("num_hidden_layers")
    return from_layer_types(
        config, ["sliding_attention" if (index + 1) % 2 else "full_attention" for index in range(num_layers)]
    )


@family("nemotron-nas", "deci", "decilm", reads=("block_configs",))
def _nemotron_nas(config: ConfigFields) -> list[ModelLayer]:
    """DeciLM ``block_configs``: per-layer kv heads (num_attention_heads / n_heads_in_group)."""
    blocks = config.get("block_configs")
    if not isinstance(blocks, list) or not blocks:
        raise ModelConfigError("nemotron-nas config lacks a non-empty block_configs list")
    heads = config.integer("num_attention_heads")
    head_size = config.head_size()
    layers: list[ModelLayer] = []
    for index, block in enumerate(blocks):
        attention = block.get("attention", {}) if isinstance(block, Mapping) else None
        if not isinstance(attention, Mapping):
            raise ModelConfigError(f"block_configs[{index}] lacks an 'attention' mapping")
        if attention.get("no_op"):
            layers.append(NoCacheLayer(reason="no_op attention"))
            continue
        if attention.get("replace_with_linear"):
            layers.append(NoCacheLayer(reason="attention replaced with linear"))
            continue
        group = attention.get("n_heads_in_group")
        if not isinstance(group, int) or group < 1 or heads % group:
            raise ModelConfigError(
                f"block_configs[{index}].attention.n_heads_in_group must be a positive divisor of "
                f"num_attention_heads={heads}, got {group!r}"
            )
        window = attention.get("window_length")
        spec: LayerCacheSpec = SlidingWindow(window_tokens=window) if window else FullAttention()
        layers.append(AttentionLayer(spec=spec, num_kv_heads=heads // group, head_size=head_size))
    return layers


@family("llama4", "llama4_text", defaults={
    "head_dim": 128, "num_key_value_heads": 8, "attention_chunk_size": 8192, "no_rope_layer_interval": 4,
    "max_position_embeddings": 131072,
}, reads=("attention_chunk_size", "no_rope_layers"))
def _llama4(config: ConfigFields) -> list[ModelLayer]:
    """Chunked local attention on RoPE layers; NoPE layers (every 4th by default) are global."""
    num_layers = config.integer("num_hidden_layers")
    rope_flags = config.get("no_rope_layers")
    if not rope_flags:  # empty or missing: a NoPE layer every no_rope_layer_interval layers
        interval = config.integer("no_rope_layer_interval")
        rope_flags = [int((index + 1) % interval != 0) for index in range(num_layers)]
    chunk = config.get("attention_chunk_size")
    return from_layer_types(
        config, ["chunked_attention" if flag and chunk else "full_attention" for flag in rope_flags]
    )
