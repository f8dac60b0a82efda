"""Hybrid families: recurrent layers (mamba, gated DeltaNet) beside attention layers."""

from __future__ import annotations

from kvgroups.errors import ModelConfigError
from kvgroups.kinds import FullAttention
from kvgroups.models.config_fields import ConfigFields, family, from_layer_types
from kvgroups.models.layers import (
    GatedDeltaNetLayer,
    Mamba2Layer,
    ModelLayer,
    NoCacheLayer,
)


def _gated_deltanet(config: ConfigFields) -> GatedDeltaNetLayer:
    return GatedDeltaNetLayer(
        num_key_heads=config.integer("linear_num_key_heads"),
        key_head_dim=config.integer("linear_key_head_dim"),
        num_value_heads=config.integer("linear_num_value_heads"),
        value_head_dim=config.integer("linear_value_head_dim"),
        conv_kernel=config.integer("linear_conv_kernel_dim", minimum=2),
    )


@family("qwen3_next", defaults={
    "head_dim": 256, "num_key_value_heads": 2, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "max_position_embeddings": 32768,
}, layer_types={"linear_attention": _gated_deltanet})
def _qwen3_next(config: ConfigFields) -> list[ModelLayer]:
    """Every ``full_attention_interval``-th layer is full attention, the others Gated DeltaNet."""
    interval = config.integer("full_attention_interval")
    num_layers = config.integer("num_hidden_layers")
    return from_layer_types(
        config,
        ["linear_attention" if (index + 1) % interval else "full_attention" for index in range(num_layers)],
    )


@family("nemotron_h", defaults={
    "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "num_key_value_heads": 8,
}, reads_layer_types=False)  # its reader maps layers_block_type / layer_types to its own symbols
def _nemotron_h(config: ConfigFields) -> list[ModelLayer]:
    """``hybrid_override_pattern``: M mamba2, * attention, - MLP, E MoE (the last two cache nothing)."""
    pattern = config.get("hybrid_override_pattern")
    block_types = config.get("layers_block_type") or config.get("layer_types")
    if isinstance(pattern, str):
        symbols = list(pattern)
    elif isinstance(block_types, list):
        names = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
                 "mlp": "-", "moe": "E"}
        unknown = sorted({str(kind) for kind in block_types if kind not in names})
        if unknown:
            raise ModelConfigError(f"layers_block_type has unknown entries {unknown}")
        symbols = [names[kind] for kind in block_types]
    else:
        raise ModelConfigError("nemotron_h config lacks hybrid_override_pattern (or layers_block_type)")
    mamba = Mamba2Layer(
        num_heads=config.integer("mamba_num_heads"), head_dim=config.integer("mamba_head_dim"),
        n_groups=config.integer("n_groups"), state_size=config.integer("ssm_state_size"),
        conv_kernel=config.integer("conv_kernel", minimum=2),
    )
    layers: list[ModelLayer] = []
    for index, symbol in enumerate(symbols):
        if symbol == "M":
            layers.append(mamba)
        elif symbol == "*":
            layers.append(config.attention(FullAttention(), "attention_head_dim", "head_dim"))
        elif symbol in "-E":
            layers.append(NoCacheLayer(reason="mlp" if symbol == "-" else "moe"))
        else:
            raise ModelConfigError(
                f"hybrid_override_pattern position {index}: {symbol!r} is not one of M, *, -, E"
            )
    return layers
