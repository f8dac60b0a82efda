"""Mamba families: mamba (v1) and mamba2 mixers alone or beside attention layers.

Which layers attend follows each family's transformers config class (``attn_layer_period`` /
``attn_layer_offset``, ``attn_layer_indices``, ``layer_types``, ``layers_block_type``,
``hybrid_override_pattern``); the state shapes follow vLLM's getters for each model.
``mamba_ssm_cache_dtype`` names the SSM states' dtype where a config sets it (Nemotron-H
defaults to float32, as vLLM and transformers do); conv states keep the model dtype.
"""

from __future__ import annotations

from kvgroups.core.cache_specs import FullAttention
from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family, from_layer_types
from kvgroups.models.layers import AttentionLayer, ModelLayer, NoCacheLayer, ParallelLayer
from kvgroups.models.state_layers import Mamba1Layer, Mamba2Layer

# mamba_* / ssm_* / conv_* fields these families carry that change no cache size.
_NO_CACHE_EFFECT = (
    "mamba_conv_bias", "mamba_proj_bias", "mamba_dt_rank", "mamba_chunk_size", "mamba_hidden_act",
    "mamba_rms_norm", "mamba_norm_before_gate", "mamba_use_mlp", "mamba_dt_min", "mamba_dt_max",
    "mamba_dt_init_floor", "mamba_dt_scale", "mamba_dt_init", "ssm_multipliers", "ssm_in_multiplier",
    "ssm_out_multiplier", "conv_bias", "mamba_ssm_cache_dtype",
)
_MAMBA_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand")
# transformers' BambaConfig / GraniteMoeHybridConfig / FalconH1Config defaults.
_MAMBA2_DEFAULTS = {"mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
                    "mamba_d_conv": 4, "mamba_expand": 2}


def _mamba2(config: ConfigFields, intermediate: int, intermediate_from: str) -> Mamba2Layer:
    """A mamba2 mixer from the ``mamba_*`` fields (Bamba, GraniteMoeHybrid, Falcon-H1)."""
    heads = config.integer("mamba_n_heads")
    if config.get("mamba_d_head") == "auto":
        if intermediate % heads:
            raise ModelConfigError(f"mamba_n_heads={heads} does not divide {intermediate_from}={intermediate}")
        head_dim = intermediate // heads
    else:
        head_dim = config.integer("mamba_d_head")
    if heads * head_dim != intermediate:
        raise ModelConfigError(
            f"mamba_n_heads * mamba_d_head = {heads} * {head_dim} = {heads * head_dim} differs from "
            f"{intermediate_from}={intermediate} (model_type {config.model_type!r})"
        )
    return Mamba2Layer(num_heads=heads, head_dim=head_dim, n_groups=config.integer("mamba_n_groups"),
                       state_size=config.integer("mamba_d_state"),
                       conv_kernel=config.integer("mamba_d_conv", minimum=2))


def _expanded(config: ConfigFields) -> int:
    return config.integer("mamba_expand") * config.integer("hidden_size")


def _attention(config: ConfigFields) -> ModelLayer:
    return config.attention(FullAttention())


@family("nemotron_h", defaults={
    "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "num_key_value_heads": 8, "mamba_ssm_cache_dtype": "float32",
}, reads_layer_types=False,  # its reader maps layers_block_type / layer_types to its own symbols
   reads=(*_NO_CACHE_EFFECT, "hybrid_override_pattern", "layers_block_type", "mamba_num_heads", "mamba_head_dim",
          "n_groups", "ssm_state_size", "conv_kernel"))
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


@family("jamba", defaults={
    "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "num_key_value_heads": 8, "max_position_embeddings": 262144,
}, reads_layer_types=False,
   reads=(*_NO_CACHE_EFFECT, "attn_layer_period", "attn_layer_offset", "mamba_d_state", "mamba_d_conv",
          "mamba_expand"))
def _jamba(config: ConfigFields) -> list[ModelLayer]:
    """Attention where ``layer % attn_layer_period == attn_layer_offset``, mamba (v1) elsewhere."""
    period, offset = config.integer("attn_layer_period"), config.integer("attn_layer_offset", minimum=0)
    if offset >= period:
        raise ModelConfigError(f"attn_layer_offset={offset} must be smaller than attn_layer_period={period}")
    mamba = Mamba1Layer(intermediate_size=_expanded(config), state_size=config.integer("mamba_d_state"),
                        conv_kernel=config.integer("mamba_d_conv", minimum=2))
    return [_attention(config) if index % period == offset else mamba
            for index in range(config.integer("num_hidden_layers"))]


@family("bamba", defaults={**_MAMBA2_DEFAULTS, "num_key_value_heads": 8, "max_position_embeddings": 262144},
        reads_layer_types=False, reads=(*_NO_CACHE_EFFECT, *_MAMBA_FIELDS, "attn_layer_indices"))
def _bamba(config: ConfigFields) -> list[ModelLayer]:
    """Attention at ``attn_layer_indices``, mamba2 elsewhere."""
    attention = config.layer_indices("attn_layer_indices")
    mamba = _mamba2(config, _expanded(config), "mamba_expand * hidden_size")
    return [_attention(config) if index in attention else mamba
            for index in range(config.integer("num_hidden_layers"))]


def _granite_mamba(config: ConfigFields) -> ModelLayer:
    return _mamba2(config, _expanded(config), "mamba_expand * hidden_size")


@family("granitemoehybrid", defaults={**_MAMBA2_DEFAULTS, "max_position_embeddings": 2048},
        layer_types={"mamba": _granite_mamba, "linear_attention": _granite_mamba, "attention": _attention},
        reads=(*_NO_CACHE_EFFECT, *_MAMBA_FIELDS))
def _granite_hybrid(config: ConfigFields) -> list[ModelLayer]:
    """``layer_types`` (``mamba`` / ``attention``); without it every layer is mamba2, as in transformers."""
    return from_layer_types(config, ["mamba"] * config.integer("num_hidden_layers"))


@family("falcon_h1", defaults={**_MAMBA2_DEFAULTS, "mamba_d_ssm": 1024, "num_key_value_heads": 8,
                               "max_position_embeddings": 8192},
        reads_layer_types=False, reads=(*_NO_CACHE_EFFECT, *_MAMBA_FIELDS, "mamba_d_ssm", "attn_layer_indices"))
def _falcon_h1(config: ConfigFields) -> list[ModelLayer]:
    """Attention and mamba2 side by side in every layer (``mamba_d_ssm`` channels wide)."""
    if config.data.get("attn_layer_indices"):
        raise ModelConfigError("falcon_h1: attn_layer_indices is not read by transformers or vLLM (every layer "
                               f"attends); got {config.data['attn_layer_indices']!r}")
    if config.data.get("mamba_d_ssm", 0) is None:  # an explicit null: the expanded width, as vLLM reads it
        intermediate, source = _expanded(config), "mamba_expand * hidden_size"
    else:
        intermediate = config.integer("mamba_d_ssm")
        source = "mamba_d_ssm" if "mamba_d_ssm" in config.data else "mamba_d_ssm (default)"
    layer = ParallelLayer(mixers=(_attention(config), _mamba2(config, intermediate, source)))
    return [layer] * config.integer("num_hidden_layers")


@family("zamba2", defaults={
    "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8,
    "num_attention_heads": 32, "hidden_size": 2560, "num_hidden_layers": 54, "max_position_embeddings": 4096,
}, reads_layer_types=False,
   reads=(*_NO_CACHE_EFFECT, "layers_block_type", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_ngroups",
          "n_mamba_heads", "mamba_headdim", "hybrid_layer_ids"))
def _zamba2(config: ConfigFields) -> list[ModelLayer]:
    """``layers_block_type``: ``mamba`` layers keep a mamba2 state; ``hybrid`` layers run a shared
    attention block before their mamba2 mixer and keep a K/V cache of their own at each position.

    The attention works on ``2 * hidden_size`` (hidden state and embeddings): head_dim is
    ``2 * hidden_size / num_attention_heads``; mamba heads are ``mamba_expand * hidden_size /
    n_mamba_heads`` wide (transformers derives both).
    """
    hidden, heads = config.integer("hidden_size"), config.integer("num_attention_heads")
    block_types = config.get("layers_block_type") or config.get("layer_types")
    num_layers = config.integer("num_hidden_layers")
    if block_types is None:  # transformers' default pattern
        block_types = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3
                       + ["hybrid"] + ["mamba"] * 2)
    if not isinstance(block_types, list) or len(block_types) != num_layers:
        raise ModelConfigError(f"layers_block_type must list {num_layers} entries, got {block_types!r}")
    intermediate, mamba_heads = _expanded(config), config.integer("n_mamba_heads")
    if intermediate % mamba_heads:
        raise ModelConfigError(f"n_mamba_heads={mamba_heads} does not divide mamba_expand * hidden_size={intermediate}")
    head_dim = intermediate // mamba_heads
    if config.data.get("mamba_headdim") not in (None, head_dim):
        raise ModelConfigError(
            f"mamba_headdim={config.data['mamba_headdim']} disagrees with mamba_expand * hidden_size / n_mamba_heads "
            f"= {intermediate} / {mamba_heads} = {head_dim} (transformers derives it; is n_mamba_heads missing?)"
        )
    mamba = Mamba2Layer(num_heads=mamba_heads, head_dim=head_dim, n_groups=config.integer("mamba_ngroups"),
                        state_size=config.integer("mamba_d_state"),
                        conv_kernel=config.integer("mamba_d_conv", minimum=2))
    if (2 * hidden) % heads:
        raise ModelConfigError(f"num_attention_heads={heads} does not divide 2 * hidden_size={2 * hidden}")
    # transformers derives attention_head_dim and lets a config that names it override it.
    head_size = config.integer("attention_head_dim") if config.get("attention_head_dim") else 2 * hidden // heads
    attention = AttentionLayer(spec=FullAttention(), num_kv_heads=config.num_kv_heads(), head_size=head_size)
    hybrid = ParallelLayer(mixers=(attention, mamba))
    kinds: dict[str, ModelLayer] = {"mamba": mamba, "linear_attention": mamba, "hybrid": hybrid}
    unknown = sorted({str(kind) for kind in block_types if kind not in kinds})
    if unknown:
        raise ModelConfigError(f"layers_block_type has entries {unknown}; expected mamba or hybrid")
    hybrid_ids = [index for index, kind in enumerate(block_types) if kind == "hybrid"]
    if config.data.get("hybrid_layer_ids") not in (None, hybrid_ids):  # derived; saved configs repeat it
        raise ModelConfigError(f"hybrid_layer_ids {config.data['hybrid_layer_ids']!r} disagrees with "
                               f"layers_block_type, whose hybrid layers are {hybrid_ids}")
    return [kinds[kind] for kind in block_types]


@family("mamba", "falcon_mamba", defaults={"state_size": 16, "conv_kernel": 4, "expand": 2},
        reads_layer_types=False,
        reads=(*_NO_CACHE_EFFECT, "state_size", "conv_kernel", "expand", "intermediate_size"))
def _mamba(config: ConfigFields) -> list[ModelLayer]:
    """Mamba (v1) in every layer, ``intermediate_size`` channels (else ``expand * hidden_size``)."""
    intermediate = (config.integer("intermediate_size") if config.get("intermediate_size") is not None
                    else config.integer("expand") * config.integer("hidden_size"))
    layer = Mamba1Layer(intermediate_size=intermediate, state_size=config.integer("state_size"),
                        conv_kernel=config.integer("conv_kernel", minimum=2))
    return [layer] * config.integer("num_hidden_layers")


@family("mamba2", defaults={"num_heads": 128, "head_dim": 64, "state_size": 128, "expand": 2, "conv_kernel": 4,
                            "n_groups": 8, "hidden_size": 4096, "num_hidden_layers": 64},
        reads_layer_types=False, reads=(*_NO_CACHE_EFFECT, "state_size", "conv_kernel", "expand", "n_groups"))
def _mamba2_family(config: ConfigFields) -> list[ModelLayer]:
    """Mamba2 in every layer; ``num_heads * head_dim`` must be ``expand * hidden_size``."""
    heads, head_dim = config.integer("num_heads"), config.integer("head_dim")
    intermediate = config.integer("expand") * config.integer("hidden_size")
    if heads * head_dim != intermediate:
        raise ModelConfigError(
            f"num_heads * head_dim = {heads * head_dim} differs from expand * hidden_size = {intermediate}"
        )
    layer = Mamba2Layer(num_heads=heads, head_dim=head_dim, n_groups=config.integer("n_groups"),
                        state_size=config.integer("state_size"), conv_kernel=config.integer("conv_kernel", minimum=2))
    return [layer] * config.integer("num_hidden_layers")
