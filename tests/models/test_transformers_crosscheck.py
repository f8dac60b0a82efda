"""Our per-layer kinds, counts and cache geometry agree with transformers' own config classes.

Every bundled config and every fixture is loaded through ``transformers.CONFIG_MAPPING``; each layer
is described from transformers' config object (its ``layer_types``, or the family's own list, and the
attribute names of its class) and compared with the layer our reader built. Skipped when transformers
is not installed; configs of model types it does not know (DeciLM / nemotron-nas and MiniMax-M1 ship
as remote code) are skipped one by one.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest

from kvgroups.core.cache_specs import ChunkedLocal, SlidingWindow
from kvgroups.models.compressed_layers import CompressedAttentionLayer
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.layers import (
    AttentionLayer,
    CrossAttentionLayer,
    IndexedMLALayer,
    MLALayer,
    ModelLayer,
    NoCacheLayer,
    ParallelLayer,
)
from kvgroups.models.state_layers import (
    GatedDeltaNetLayer,
    KimiDeltaLayer,
    LightningAttentionLayer,
    Mamba1Layer,
    Mamba2Layer,
    ShortConvLayer,
)
from tests.support.helpers import every_config

transformers = pytest.importorskip("transformers")

CONFIGS = every_config()
# transformers' MiniMaxConfig reads layer_types and ignores attn_type_list: MiniMax-M1 written that way.
_M1 = CONFIGS["minimax-m1"]
CONFIGS["minimax-m1 as minimax"] = {
    **_M1, "model_type": "minimax",
    "layer_types": ["full_attention" if kind else "linear_attention" for kind in _M1["attn_type_list"]],
}


def transformers_config(config: dict[str, Any]) -> Any:
    model_type = config["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers does not know model_type {model_type!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(config))
    return loaded.get_text_config() if hasattr(loaded, "get_text_config") else loaded


def ours(layer: ModelLayer) -> tuple[Any, ...]:
    """A layer as a comparable tuple: its kind and the sizes its cache depends on."""
    if isinstance(layer, AttentionLayer):
        if isinstance(layer.spec, SlidingWindow):
            kind = f"sliding{layer.spec.window_tokens}"
        elif isinstance(layer.spec, ChunkedLocal):
            kind = f"chunked{layer.spec.chunk_tokens}"
        else:
            kind = "full"
        return kind, layer.num_kv_heads, layer.head_size, layer.value_head_size or layer.head_size
    if isinstance(layer, CrossAttentionLayer):
        return "cross", layer.num_kv_heads, layer.head_size
    if isinstance(layer, MLALayer):
        return "mla", layer.kv_lora_rank, layer.qk_rope_head_dim
    if isinstance(layer, IndexedMLALayer):
        kind = "mla+indexer" if layer.has_indexer else "mla"
        return kind, layer.kv_lora_rank, layer.qk_rope_head_dim, layer.index_head_dim
    if isinstance(layer, Mamba1Layer):
        return "mamba", layer.intermediate_size, layer.state_size, layer.conv_kernel
    if isinstance(layer, Mamba2Layer):
        return "mamba2", layer.num_heads, layer.head_dim, layer.n_groups, layer.state_size, layer.conv_kernel
    if isinstance(layer, GatedDeltaNetLayer):
        return ("deltanet", layer.num_key_heads, layer.key_head_dim, layer.num_value_heads, layer.value_head_dim,
                layer.conv_kernel)
    if isinstance(layer, ShortConvLayer):
        return "short_conv", layer.channels, layer.conv_kernel
    if isinstance(layer, LightningAttentionLayer):
        return "lightning", layer.num_heads, layer.head_dim
    if isinstance(layer, KimiDeltaLayer):
        return "kimi_delta", layer.num_heads, layer.head_dim, layer.conv_kernel
    if isinstance(layer, ParallelLayer):
        return tuple(ours(mixer) for mixer in layer.mixers)
    if isinstance(layer, CompressedAttentionLayer):
        return ("compressed", layer.compress_ratio, layer.sparse, layer.head_dim, layer.rope_dim, layer.window_tokens,
                layer.index_head_dim)
    assert isinstance(layer, NoCacheLayer)
    return ("none",)


def _attention(text: Any, index: int, kind: str) -> tuple[Any, ...]:
    per_layer = getattr(text, "per_layer_config", None)
    if per_layer is not None and text.model_type == "gemma4_text":
        kv, head = per_layer[index].num_key_value_heads, per_layer[index].head_dim
    elif text.model_type == "dbrx":  # DbrxAttention: attn_config.kv_n_heads heads of d_model / n_heads
        kv, head = text.attn_config.kv_n_heads, text.d_model // text.n_heads
    else:
        kv = text.num_key_value_heads
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    value = getattr(text, "v_head_dim", None) or head
    if kind == "sliding_attention":
        window = text.sliding_window
        if text.model_type == "mimo_v2_flash":
            # transformers counts the query in (sliding_window_size + 1) and hard-codes twice the KV heads
            # (modeling_mimo_v2_flash); vLLM's window, and ours, is sliding_window_size.
            window, kv = window - 1, 2 * kv
        limit = getattr(text, "max_position_embeddings", None)
        return (f"sliding{window}" if limit is None or window < limit else "full"), kv, head, value
    if kind == "chunked_attention":
        return f"chunked{text.attention_chunk_size}", kv, head, value
    return "full", kv, head, value


def _mixer(text: Any) -> tuple[Any, ...]:
    """The recurrent mixer of a ``linear_attention`` layer, from the attributes of its family's class."""
    t = text
    mixers = {
        "mamba": lambda: ("mamba", t.intermediate_size, t.state_size, t.conv_kernel),
        "falcon_mamba": lambda: ("mamba", t.intermediate_size, t.state_size, t.conv_kernel),
        "jamba": lambda: ("mamba", t.mamba_expand * t.hidden_size, t.mamba_d_state, t.mamba_d_conv),
        "mamba2": lambda: ("mamba2", t.num_heads, t.head_dim, t.n_groups, t.state_size, t.conv_kernel),
        "nemotron_h": lambda: ("mamba2", t.mamba_num_heads, t.mamba_head_dim, t.n_groups, t.ssm_state_size,
                               t.conv_kernel),
        "zamba2": lambda: ("mamba2", t.n_mamba_heads, t.mamba_headdim, t.mamba_ngroups, t.mamba_d_state,
                           t.mamba_d_conv),
        "minimax": lambda: ("lightning", t.num_attention_heads, t.head_dim),
        "kimi_linear": lambda: ("kimi_delta", t.linear_num_heads, t.linear_head_dim, t.linear_conv_kernel_dim),
    }
    if t.model_type in mixers:
        return mixers[t.model_type]()
    if t.model_type in ("bamba", "granitemoehybrid", "falcon_h1"):
        return "mamba2", t.mamba_n_heads, t.mamba_d_head, t.mamba_n_groups, t.mamba_d_state, t.mamba_d_conv
    return ("deltanet", t.linear_num_key_heads, t.linear_key_head_dim, t.linear_num_value_heads,
            t.linear_value_head_dim, t.linear_conv_kernel_dim)


def theirs(text: Any) -> list[tuple[Any, ...]]:
    """Every layer as transformers' config object describes it."""
    count = text.num_hidden_layers
    if text.model_type == "mllama_text_model":
        return [("cross", text.num_key_value_heads, text.hidden_size // text.num_attention_heads)
                if index in text.cross_attention_layers else _attention(text, index, "full_attention")
                for index in range(count)]
    layer_types = getattr(text, "layer_types", None)
    if text.model_type == "deepseek_v4":  # DeepseekV4Config turns compress_ratios into layer_types and compress_rates
        return [("compressed", text.compress_rates.get(kind, 1), kind == "compressed_sparse_attention", text.head_dim,
                 text.qk_rope_head_dim, text.sliding_window, text.index_head_dim) for kind in layer_types]
    if getattr(text, "kv_lora_rank", None) and not layer_types:
        return [("mla", text.kv_lora_rank, text.qk_rope_head_dim)] * count
    if layer_types is None:
        return [_attention(text, index, "sliding_attention" if getattr(text, "sliding_window", None)
                           else "full_attention") for index in range(count)]
    sharing = getattr(text, "kv_sharing_modes", [None] * count)
    indexers = getattr(text, "indexer_types", ["full"] * count)
    layers: list[tuple[Any, ...]] = []
    for index, kind in enumerate(layer_types):
        if sharing[index] == "reuse" or kind in ("mlp", "moe"):
            layers.append(("none",))
        elif kind == "indexed_attention":
            base = (text.kv_lora_rank, text.qk_rope_head_dim, text.index_head_dim)
            layers.append(("mla+indexer" if indexers[index] == "full" else "mla", *base))
        elif kind in ("linear_attention", "mamba"):
            layers.append(_mixer(text))
        elif text.model_type == "kimi_linear":  # its full-attention layers are MLA
            layers.append(("mla", text.kv_lora_rank, text.qk_rope_head_dim))
        elif kind == "conv":
            layers.append(("short_conv", text.hidden_size, text.conv_L_cache))
        elif kind == "hybrid":
            if text.model_type == "zamba2":
                attention: tuple[Any, ...] = ("full", text.num_key_value_heads, text.attention_head_dim,
                                              text.attention_head_dim)
            else:
                attention = _attention(text, index, "full_attention")
            layers.append((attention, _mixer(text)))
        else:
            layers.append(_attention(text, index, kind))
    return layers


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layers_match_transformers(name: str) -> None:
    config = CONFIGS[name]
    text = transformers_config(config)
    assert [ours(layer) for layer in model_spec_from_config(config).layers] == theirs(text)
