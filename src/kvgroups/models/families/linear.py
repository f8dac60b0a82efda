"""Linear-attention hybrids beyond Qwen3-Next: Kimi Delta Attention (Kimi-Linear, Bailing's hybrid,
beside MLA layers), gated DeltaNet in OLMo-Hybrid and Lara-Mini, LFM2-MoE and LFM3's short
convolutions; each beside attention layers, as their ``transformers`` config classes lay them out.

State shapes follow vLLM (``MambaStateShapeCalculator``): a KDA layer keeps its q, k and v short
convolutions as one conv state of ``3 * heads * head_dim`` channels (transformers concatenates them
the same way) and a ``(heads, head_dim, head_dim)`` recurrent state in float32 whatever the model
dtype (vLLM's ``kda_state_dtype``; transformers stores it ``.to(torch.float32)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family, from_layer_types
from kvgroups.models.families.hybrid import short_conv_layer
from kvgroups.models.layers import MLALayer, ModelLayer
from kvgroups.models.state_layers import GatedDeltaNetLayer, KimiDeltaLayer

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")


def _mla(config: ConfigFields) -> ModelLayer:
    return MLALayer(kv_lora_rank=config.integer("kv_lora_rank"), qk_rope_head_dim=config.integer("qk_rope_head_dim"))


def _kimi_settings(config: ConfigFields) -> Mapping[str, Any]:
    """Kimi's published configs nest the KDA settings in ``linear_attn_config``; transformers reads them
    from there first, then from its own ``linear_*`` fields."""
    nested = config.get("linear_attn_config") or {}
    if not isinstance(nested, Mapping):
        raise ModelConfigError(f"linear_attn_config must be a mapping, got {nested!r}")
    return nested


def _kimi_delta(config: ConfigFields) -> ModelLayer:
    nested = _kimi_settings(config)
    values = {name: nested.get(key, config.get(name)) for name, key in (
        ("linear_num_heads", "num_heads"), ("linear_head_dim", "head_dim"),
        ("linear_conv_kernel_dim", "short_conv_kernel_size"))}
    for name, value in values.items():
        if not isinstance(value, int) or value < (2 if name == "linear_conv_kernel_dim" else 1):
            raise ModelConfigError(f"config field {name!r} (or its linear_attn_config entry) must be a positive "
                                   f"int, got {value!r} (model_type {config.model_type!r})")
    return KimiDeltaLayer(num_heads=values["linear_num_heads"], head_dim=values["linear_head_dim"],
                          conv_kernel=values["linear_conv_kernel_dim"])


@family("kimi_linear", defaults={
    "num_hidden_layers": 27, "num_attention_heads": 32, "hidden_size": 2304, "max_position_embeddings": 1048576,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "linear_head_dim": 128, "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
}, aliases={"max_position_embeddings": "model_max_length"},
   layer_types={"linear_attention": _kimi_delta, "full_attention": _mla},
   reads=(*_MLA_FIELDS, "linear_attn_config", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"))
def _kimi_linear(config: ConfigFields) -> list[ModelLayer]:
    """``layer_types``, else ``linear_attn_config``'s 1-indexed ``kda_layers`` / ``full_attn_layers``,
    else transformers' default (MLA at layers 4, 8, 12, ...); KDA layers and MLA layers."""
    layers = config.integer("num_hidden_layers")
    nested = _kimi_settings(config)
    if "full_attn_layers" in nested and "kda_layers" in nested:
        kinds: list[str | None] = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            numbers = nested[key]
            if not isinstance(numbers, list) or not all(isinstance(n, int) and 1 <= n <= layers for n in numbers):
                raise ModelConfigError(f"linear_attn_config.{key} must list layer numbers 1..{layers}, got {numbers!r}")
            for number in numbers:
                kinds[number - 1] = kind
        missing = [index + 1 for index, kind in enumerate(kinds) if kind is None]
        if missing:
            raise ModelConfigError(f"linear_attn_config names no kind for layers {missing} (1-indexed)")
        return from_layer_types(config, [str(kind) for kind in kinds])
    return from_layer_types(config, ["full_attention" if index and index % 4 == 0 else "linear_attention"
                                     for index in range(layers)])


def _bailing_delta(config: ConfigFields) -> ModelLayer:
    """transformers copies ``head_dim`` / ``num_attention_heads`` / ``short_conv_kernel_size`` into the
    ``linear_*`` fields before ``head_dim`` becomes the rope size, and saves both: the ``linear_*``
    fields win where a config carries them."""
    def first(*names: str) -> int:
        for name in names:
            if config.data.get(name) is not None:
                return config.integer(name)
        return config.integer(names[-1])

    return KimiDeltaLayer(num_heads=first("linear_num_heads", "num_attention_heads"),
                          head_dim=first("linear_head_dim", "head_dim"),
                          conv_kernel=first("linear_conv_kernel_dim", "short_conv_kernel_size"))


@family("bailing_hybrid", defaults={
    "num_hidden_layers": 42, "num_attention_heads": 32, "hidden_size": 2560, "max_position_embeddings": 262144,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 128, "short_conv_kernel_size": 4, "layer_group_size": 6,
}, layer_types={"linear_attention": _bailing_delta, "full_attention": _mla},
   reads=(*_MLA_FIELDS, "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"))
def _bailing_hybrid(config: ConfigFields) -> list[ModelLayer]:
    """Every ``layer_group_size``-th layer MLA, the others KDA."""
    every = config.integer("layer_group_size")
    return from_layer_types(config, ["full_attention" if (index + 1) % every == 0 else "linear_attention"
                                     for index in range(config.integer("num_hidden_layers"))])


def _olmo_deltanet(config: ConfigFields) -> ModelLayer:
    """Gated DeltaNet whose head counts default to ``num_attention_heads`` and head sizes to
    ``0.75 * hidden_size / key heads`` (keys) and twice that (values), as OlmoHybridConfig derives them."""
    key_heads = config.integer("linear_num_key_heads" if config.get("linear_num_key_heads") else "num_attention_heads")
    value_heads = config.integer(
        "linear_num_value_heads" if config.get("linear_num_value_heads") else "num_attention_heads")
    key_dim = (config.integer("linear_key_head_dim") if config.get("linear_key_head_dim")
               else int(0.75 * config.integer("hidden_size") / key_heads))
    value_dim = config.integer("linear_value_head_dim") if config.get("linear_value_head_dim") else 2 * key_dim
    return GatedDeltaNetLayer(num_key_heads=key_heads, key_head_dim=key_dim, num_value_heads=value_heads,
                              value_head_dim=value_dim, conv_kernel=config.integer("linear_conv_kernel_dim", minimum=2))


# OLMo-Hybrid's linear_a_log_* / linear_dt_* / linear_allow_neg_eigval shape the gates, not the states.
_OLMO_GATES = ("linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max", "linear_dt_init_floor",
               "linear_allow_neg_eigval")


@family("olmo_hybrid", defaults={
    "num_hidden_layers": 32, "num_attention_heads": 30, "hidden_size": 3840, "max_position_embeddings": 65536,
    "linear_conv_kernel_dim": 4,
}, layer_types={"linear_attention": _olmo_deltanet},
   reads=("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", *_OLMO_GATES))
def _olmo_hybrid(config: ConfigFields) -> list[ModelLayer]:
    """Every fourth layer full attention (the last one when there are fewer than four), the others gated DeltaNet."""
    layers = config.integer("num_hidden_layers")
    kinds = ["full_attention" if index % 4 == 3 else "linear_attention" for index in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return from_layer_types(config, kinds)


def _lara_deltanet(config: ConfigFields) -> ModelLayer:
    return GatedDeltaNetLayer(
        num_key_heads=config.integer("linear_num_key_heads"), key_head_dim=config.integer("linear_key_head_dim"),
        num_value_heads=config.integer("linear_num_value_heads"),
        value_head_dim=config.integer("linear_value_head_dim"),
        conv_kernel=config.integer("linear_conv_kernel_dim", minimum=2))


_LARA_PATTERN = ["linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention"]


@family("lara_mini", defaults={
    "num_hidden_layers": 34, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
    "hidden_size": 1024, "sliding_window": 512, "max_position_embeddings": 131072, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 8, "linear_num_value_heads": 16,
}, layer_types={"linear_attention": _lara_deltanet},
   reads=("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim"))
def _lara_mini(config: ConfigFields) -> list[ModelLayer]:
    """The released period of five: linear, sliding, linear, full, sliding."""
    return from_layer_types(config, [_LARA_PATTERN[index % 5] for index in range(config.integer("num_hidden_layers"))])


_CONV_FIELDS = ("conv_L_cache", "conv_dim", "conv_dim_out", "conv_bias", "conv_use_xavier_init")


@family("lfm2_moe", defaults={"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "hidden_size": 2048, "max_position_embeddings": 128000, "conv_L_cache": 3},
        layer_types={"conv": short_conv_layer}, reads=_CONV_FIELDS)
def _lfm2_moe(config: ConfigFields) -> list[ModelLayer]:
    """Only ``layer_types`` (``conv`` / ``full_attention``) says which layer is which; transformers has no default."""
    raise ModelConfigError("lfm2_moe config lacks layer_types (conv / full_attention per layer)")


@family("lfm3", defaults={"num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4,
                          "head_dim": 128, "hidden_size": 2048, "sliding_window": 256,
                          "max_position_embeddings": 128000, "conv_L_cache": 7},
        layer_types={"conv": short_conv_layer}, reads=_CONV_FIELDS)
def _lfm3(config: ConfigFields) -> list[ModelLayer]:
    """Full attention at layers 2, 6, 10, ...; sliding at 4, 8, ...; short convolutions elsewhere."""
    return from_layer_types(config, [
        "full_attention" if index % 4 == 2 else "sliding_attention" if index % 4 == 0 and index else "conv"
        for index in range(config.integer("num_hidden_layers"))])
