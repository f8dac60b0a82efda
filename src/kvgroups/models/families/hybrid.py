"""Linear-attention hybrids: gated DeltaNet (Qwen3-Next, Qwen3.5), lightning attention (MiniMax),
short convolutions (LFM2), each beside full-attention layers; attention with short convolutions around it in
every layer (Inkling)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvgroups.core.cache_specs import FullAttention, SlidingWindow
from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family, from_layer_types
from kvgroups.models.layers import AttentionLayer, ModelLayer, ParallelLayer
from kvgroups.models.state_layers import ConvStates, GatedDeltaNetLayer, LightningAttentionLayer, ShortConvLayer

_GDN_FIELDS = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
               "linear_conv_kernel_dim", "mamba_ssm_dtype")


def _gated_deltanet(config: ConfigFields) -> GatedDeltaNetLayer:
    return GatedDeltaNetLayer(
        num_key_heads=config.integer("linear_num_key_heads"),
        key_head_dim=config.integer("linear_key_head_dim"),
        num_value_heads=config.integer("linear_num_value_heads"),
        value_head_dim=config.integer("linear_value_head_dim"),
        conv_kernel=config.integer("linear_conv_kernel_dim", minimum=2),
    )


def _every_interval(config: ConfigFields) -> list[ModelLayer]:
    """Every ``full_attention_interval``-th layer is full attention, the others Gated DeltaNet."""
    interval = config.integer("full_attention_interval")
    num_layers = config.integer("num_hidden_layers")
    return from_layer_types(
        config,
        ["linear_attention" if (index + 1) % interval else "full_attention" for index in range(num_layers)],
    )


_GDN_DEFAULTS: Mapping[str, Any] = {
    "head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "max_position_embeddings": 32768,
}
# Qwen3.5 names its SSM states' dtype (mamba_ssm_dtype: float32), which vLLM honours.
family("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", defaults={**_GDN_DEFAULTS, "num_key_value_heads": 2},
       layer_types={"linear_attention": _gated_deltanet}, reads=_GDN_FIELDS)(_every_interval)
family("qwen3_5", "qwen3_5_text", defaults={**_GDN_DEFAULTS, "num_key_value_heads": 4},
       layer_types={"linear_attention": _gated_deltanet}, reads=_GDN_FIELDS)(_every_interval)


def _lightning(config: ConfigFields) -> ModelLayer:
    return LightningAttentionLayer(num_heads=config.integer("num_attention_heads"), head_dim=config.head_size())


@family("minimax", "minimax_m1", "minimax_text_01", defaults={"num_key_value_heads": 8,
                                                            "max_position_embeddings": 131072},
        layer_types={"linear_attention": _lightning}, reads_layer_types=False,
        # linear_attn_alpha_factor / beta_factor scale the residual branch, not the state (transformers
        # writes both into every config it saves).
        reads=("attn_type_list", "linear_attn_alpha_factor", "linear_attn_beta_factor"))
def _minimax(config: ConfigFields) -> list[ModelLayer]:
    """``layer_types``, else ``attn_type_list`` (0 lightning, 1 softmax attention, as vLLM reads it), else
    transformers' default (even layers full)."""
    num_layers = config.integer("num_hidden_layers")
    layer_types = config.data.get("layer_types")
    attn_types = config.int_list("attn_type_list")
    from_attn_types = None
    if attn_types is not None:
        if len(attn_types) != num_layers or set(attn_types) - {0, 1}:
            raise ModelConfigError(f"attn_type_list must hold {num_layers} entries of 0 or 1, got {attn_types!r}")
        from_attn_types = ["full_attention" if kind else "linear_attention" for kind in attn_types]
    if isinstance(layer_types, list):
        if from_attn_types is not None and list(layer_types) != from_attn_types:
            raise ModelConfigError("layer_types and attn_type_list disagree on which layers are linear attention")
        return from_layer_types(config, layer_types)
    if from_attn_types is not None:
        return from_layer_types(config, from_attn_types)
    return from_layer_types(
        config, ["full_attention" if (index + 1) % 2 else "linear_attention" for index in range(num_layers)]
    )


def short_conv_layer(config: ConfigFields) -> ModelLayer:
    channels = config.integer("conv_dim") if config.get("conv_dim") is not None else config.integer("hidden_size")
    return ShortConvLayer(channels=channels, conv_kernel=config.integer("conv_L_cache", minimum=2))


@family("lfm2", defaults={"num_key_value_heads": 8, "conv_L_cache": 3, "max_position_embeddings": 128000},
        layer_types={"conv": short_conv_layer},
        reads=("conv_L_cache", "conv_dim", "conv_dim_out", "conv_bias", "conv_use_xavier_init", "full_attn_idxs"))
def _lfm2(config: ConfigFields) -> list[ModelLayer]:
    """``layer_types`` (``conv`` / ``full_attention``), else attention at ``full_attn_idxs``, else (as in
    transformers) attention everywhere."""
    num_layers = config.integer("num_hidden_layers")
    full = set(range(num_layers))
    if config.get("full_attn_idxs") is not None:
        full = config.layer_indices("full_attn_idxs")
    return from_layer_types(config, ["full_attention" if index in full else "conv" for index in range(num_layers)])


# --- Inkling: every layer attention (sliding or full) with four short convolutions around it ------------------
_INKLING_READS = ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "conv_kernel_size",
                  "local_layer_ids")
_INKLING_SLIDING, _INKLING_FULL = "hybrid_sliding", "hybrid"


def _inkling_layer(config: ConfigFields, sliding: bool) -> ModelLayer:
    """Attention (a ``sliding_window`` of the ``swa_`` heads, or the whole context) and the conv states of its K
    and V projections, of the attention's output and of the MLP's."""
    if sliding:
        window = config.sliding_window()
        attention = AttentionLayer(spec=SlidingWindow(window_tokens=window) if window else FullAttention(),
                                   num_kv_heads=config.integer("swa_num_key_value_heads"),
                                   head_size=config.integer("swa_head_dim"))
    else:
        attention = config.attention(FullAttention())
    kv_channels = attention.num_kv_heads * attention.head_size
    hidden = config.integer("hidden_size")
    convs = ConvStates(channels=(kv_channels, kv_channels, hidden, hidden),
                       conv_kernel=config.integer("conv_kernel_size", minimum=2))
    return ParallelLayer(mixers=(attention, convs))


def _inkling(default_sliding: Callable[[ConfigFields, int], bool]) -> Callable[[ConfigFields], list[ModelLayer]]:
    def read(config: ConfigFields) -> list[ModelLayer]:
        count = config.integer("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None:
            layer_types = [_INKLING_SLIDING if default_sliding(config, index) else _INKLING_FULL
                           for index in range(count)]
        if not isinstance(layer_types, list) or len(layer_types) != count or \
                set(layer_types) - {_INKLING_SLIDING, _INKLING_FULL}:
            raise ModelConfigError(f"layer_types must list {_INKLING_SLIDING!r} or {_INKLING_FULL!r} for each of "
                                   f"{count} layers, got {layer_types!r}")
        return [_inkling_layer(config, kind == _INKLING_SLIDING) for kind in layer_types]

    return read


def _inkling_local(config: ConfigFields, index: int) -> bool:
    """``local_layer_ids`` slide; without them every layer but each 6th (Inkling's config class)."""
    if config.get("local_layer_ids") is not None:
        return index in config.layer_indices("local_layer_ids")
    return bool((index + 1) % 6)


family("inkling_text", reads_layer_types=False, reads=_INKLING_READS, aliases={"sliding_window": "sliding_window_size"},
       defaults={"num_hidden_layers": 66, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                 "hidden_size": 6144, "swa_num_key_value_heads": 16, "swa_head_dim": 128, "sliding_window_size": 512,
                 "max_position_embeddings": 131072, "conv_kernel_size": 4})(_inkling(_inkling_local))
family("inkling2_text", reads_layer_types=False, reads=_INKLING_READS,
       aliases={"sliding_window": "sliding_window_size"},
       defaults={"num_hidden_layers": 48, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                 "hidden_size": 4608, "swa_num_key_value_heads": 8, "swa_head_dim": 128, "sliding_window_size": 1024,
                 "max_position_embeddings": 1048576, "conv_kernel_size": 4})(
    _inkling(lambda config, index: bool((index + 1) % 6)))
