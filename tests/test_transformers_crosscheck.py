"""Our per-layer kinds and head sizes agree with transformers' own config classes.

Skipped when transformers is not installed; configs of models transformers does not know
(DeciLM / nemotron-nas ships as remote code) are skipped one by one.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

from kvgroups.kinds import ChunkedLocal, SlidingWindow
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.layers import AttentionLayer, GatedDeltaNetLayer, Mamba2Layer, MLALayer, NoCacheLayer
from kvgroups.models.presets import load_model_config, preset_names

transformers = pytest.importorskip("transformers")


def transformers_config(config: dict[str, Any]) -> Any:
    model_type = config["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers does not know model_type {model_type!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(config))
    return loaded.get_text_config() if hasattr(loaded, "get_text_config") else loaded


def their_kinds(text: Any) -> list[str]:
    """Per-layer kinds as transformers describes them, windows that cover every position as full."""
    count = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    max_positions = getattr(text, "max_position_embeddings", None)
    window_applies = window is not None and (max_positions is None or window < max_positions)
    if getattr(text, "kv_lora_rank", None):
        return ["mla"] * count
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:
        return [f"sliding{window}" if window_applies else "full"] * count
    names = {
        "full_attention": "full", "attention": "full",
        "sliding_attention": f"sliding{window}" if window_applies else "full",
        "chunked_attention": f"chunked{getattr(text, 'attention_chunk_size', None)}",
        "linear_attention": "recurrent", "mamba": "recurrent", "mlp": "none", "moe": "none",
    }
    return [names[kind] for kind in layer_types]


def our_kinds(config: dict[str, Any]) -> list[str]:
    result = []
    for layer in model_spec_from_config(config).layers:
        if isinstance(layer, AttentionLayer):
            if isinstance(layer.spec, SlidingWindow):
                result.append(f"sliding{layer.spec.window_tokens}")
            elif isinstance(layer.spec, ChunkedLocal):
                result.append(f"chunked{layer.spec.chunk_tokens}")
            else:
                result.append("full")
        elif isinstance(layer, MLALayer):
            result.append("mla")
        elif isinstance(layer, (GatedDeltaNetLayer, Mamba2Layer)):
            result.append("recurrent")
        else:
            assert isinstance(layer, NoCacheLayer)
            result.append("none")
    return result


@pytest.mark.parametrize("name", preset_names())
def test_kinds_and_heads_match_transformers(name: str) -> None:
    config = load_model_config(name).config
    text = transformers_config(config)
    assert our_kinds(config) == their_kinds(text)
    for layer in model_spec_from_config(config).layers:
        if isinstance(layer, AttentionLayer):
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            assert (layer.num_kv_heads, layer.head_size) == (text.num_key_value_heads, head_dim)
        elif isinstance(layer, MLALayer):
            assert (layer.kv_lora_rank, layer.qk_rope_head_dim) == (text.kv_lora_rank, text.qk_rope_head_dim)
        elif isinstance(layer, Mamba2Layer):
            assert (layer.num_heads, layer.head_dim, layer.n_groups, layer.state_size, layer.conv_kernel) == (
                text.mamba_num_heads, text.mamba_head_dim, text.n_groups, text.ssm_state_size, text.conv_kernel
            )
        elif isinstance(layer, GatedDeltaNetLayer):
            assert (layer.num_key_heads, layer.key_head_dim, layer.num_value_heads, layer.value_head_dim,
                    layer.conv_kernel) == (
                text.linear_num_key_heads, text.linear_key_head_dim, text.linear_num_value_heads,
                text.linear_value_head_dim, text.linear_conv_kernel_dim,
            )
