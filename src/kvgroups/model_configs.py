"""Hugging Face ``config.json`` dicts -> :class:`~kvgroups.model_layers.ModelSpec`, per model family.

Fields and defaults follow the ``transformers`` config classes (the authority on defaults), read
without importing them. One reader per family, registered by ``model_type``; a config that
carries ``layer_types`` is read from it whatever its family.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvgroups.errors import ModelConfigError
from kvgroups.kinds import ChunkedLocal, FullAttention, LayerCacheSpec, SlidingWindow
from kvgroups.model_layers import (
    AttentionLayer,
    GatedDeltaNetLayer,
    Mamba2Layer,
    MLALayer,
    ModelLayer,
    ModelSpec,
    NoCacheLayer,
)

logger = logging.getLogger(__name__)

_GENERIC_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size")


class _Config:
    """Field access with the family's defaults and errors that name the missing field."""

    def __init__(self, data: Mapping[str, Any], model_type: str, defaults: Mapping[str, Any]) -> None:
        self.data = data
        self.model_type = model_type
        self.defaults = defaults

    def get(self, name: str, fallback: Any = None) -> Any:
        value = self.data.get(name)
        if value is None:
            value = self.defaults.get(name, fallback)
        return value

    def integer(self, name: str, *, minimum: int = 1) -> int:
        value = self.get(name)
        if value is None:
            raise ModelConfigError(f"config (model_type {self.model_type!r}) lacks field {name!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelConfigError(
                f"config field {name!r} must be an int >= {minimum}, got {value!r} "
                f"(model_type {self.model_type!r})"
            )
        return value

    def require(self, *names: str) -> None:
        missing = [name for name in names if self.get(name) is None]
        if missing:
            raise ModelConfigError(
                f"config (model_type {self.model_type!r}) lacks fields {missing}"
            )

    def head_size(self, *names: str) -> int:
        """The first of ``names`` (default ``head_dim``) set, else hidden_size / num_attention_heads."""
        for name in names or ("head_dim",):
            if self.get(name) is not None:
                return self.integer(name)
        hidden, heads = self.integer("hidden_size"), self.integer("num_attention_heads")
        if hidden % heads:
            raise ModelConfigError(
                f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} and no "
                f"head_dim is set (model_type {self.model_type!r})"
            )
        return hidden // heads

    def num_kv_heads(self) -> int:
        if self.get("num_key_value_heads") is None:
            return self.integer("num_attention_heads")
        return self.integer("num_key_value_heads")

    def sliding_window(self) -> int | None:
        """The window when set, not disabled and smaller than the longest context."""
        window = self.get("sliding_window")
        if window is None or self.get("use_sliding_window") is False:
            return None
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ModelConfigError(f"sliding_window must be a positive int or null, got {window!r}")
        max_positions = self.get("max_position_embeddings")
        if isinstance(max_positions, int) and window >= max_positions:
            return None  # the window covers every position the model can see
        return window

    def attention(self, spec: LayerCacheSpec, *head_size_fields: str) -> AttentionLayer:
        return AttentionLayer(spec=spec, num_kv_heads=self.num_kv_heads(), head_size=self.head_size(*head_size_fields))


_Reader = Callable[[_Config], list[ModelLayer]]
_READERS: dict[str, tuple[_Reader, Mapping[str, Any]]] = {}


def _reader(*model_types: str, defaults: Mapping[str, Any] | None = None) -> Callable[[_Reader], _Reader]:
    def register(function: _Reader) -> _Reader:
        for model_type in model_types:
            _READERS[model_type] = (function, defaults or {})
        return function

    return register


def supported_model_types() -> list[str]:
    return sorted(_READERS)


def _from_layer_types(config: _Config, layer_types: Sequence[Any]) -> list[ModelLayer]:
    """Layers from a ``layer_types`` list (gpt-oss, gemma, qwen3-next, ministral, ...)."""
    if len(layer_types) != config.integer("num_hidden_layers"):
        raise ModelConfigError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is "
            f"{config.integer('num_hidden_layers')}"
        )
    layers: list[ModelLayer] = []
    for index, layer_type in enumerate(layer_types):
        if layer_type == "full_attention":
            layers.append(config.attention(FullAttention()))
        elif layer_type == "sliding_attention":
            window = config.sliding_window()
            layers.append(config.attention(SlidingWindow(window_tokens=window) if window else FullAttention()))
        elif layer_type == "chunked_attention":
            layers.append(config.attention(ChunkedLocal(chunk_tokens=config.integer("attention_chunk_size"))))
        elif layer_type == "linear_attention" and config.model_type == "qwen3_next":
            layers.append(_gated_deltanet(config))
        else:
            raise ModelConfigError(
                f"layer {index}: layer_types entry {layer_type!r} is not supported for model_type "
                f"{config.model_type!r}; expected full_attention, sliding_attention or chunked_attention"
            )
    return layers


@_reader("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
def _llama_like(config: _Config) -> list[ModelLayer]:
    """Every layer alike; sliding where a window applies (qwen: from layer max_window_layers on)."""
    config.require(*_GENERIC_FIELDS)
    num_layers = config.integer("num_hidden_layers")
    window = config.sliding_window()
    first_sliding = 0
    if config.model_type.startswith("qwen") and config.get("max_window_layers") is not None:
        first_sliding = config.integer("max_window_layers", minimum=0)
    return [
        config.attention(
            SlidingWindow(window_tokens=window) if window and index >= first_sliding else FullAttention()
        )
        for index in range(num_layers)
    ]


@_reader("gemma2", defaults={"head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 8192,
                             "num_key_value_heads": 4})
def _gemma2(config: _Config) -> list[ModelLayer]:
    """Even layers slide, odd layers are global."""
    num_layers = config.integer("num_hidden_layers")
    return _from_layer_types(
        config, ["sliding_attention" if (index + 1) % 2 else "full_attention" for index in range(num_layers)]
    )


@_reader("gemma3", "gemma3_text", defaults={"head_dim": 256, "sliding_window": 4096,
                                            "max_position_embeddings": 131072, "num_key_value_heads": 4,
                                            "num_hidden_layers": 26, "num_attention_heads": 8})
def _gemma3(config: _Config) -> list[ModelLayer]:
    """Every ``sliding_window_pattern``-th layer (default 6) is global, the rest slide."""
    pattern = config.integer("sliding_window_pattern") if config.get("sliding_window_pattern") else 6
    num_layers = config.integer("num_hidden_layers")
    return _from_layer_types(
        config, ["sliding_attention" if (index + 1) % pattern else "full_attention" for index in range(num_layers)]
    )


@_reader("gpt_oss", defaults={"head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072})
def _gpt_oss(config: _Config) -> list[ModelLayer]:
    num_layers = config.integer("num_hidden_layers")
    return _from_layer_types(
        config, ["sliding_attention" if (index + 1) % 2 else "full_attention" for index in range(num_layers)]
    )


@_reader("deepseek_v2", "deepseek_v3", "kimi_k2")
def _mla(config: _Config) -> list[ModelLayer]:
    """Multi-head latent attention on every layer (MTP layers are not counted)."""
    layer = MLALayer(kv_lora_rank=config.integer("kv_lora_rank"), qk_rope_head_dim=config.integer("qk_rope_head_dim"))
    return [layer] * config.integer("num_hidden_layers")


def _gated_deltanet(config: _Config) -> GatedDeltaNetLayer:
    return GatedDeltaNetLayer(
        num_key_heads=config.integer("linear_num_key_heads"),
        key_head_dim=config.integer("linear_key_head_dim"),
        num_value_heads=config.integer("linear_num_value_heads"),
        value_head_dim=config.integer("linear_value_head_dim"),
        conv_kernel=config.integer("linear_conv_kernel_dim", minimum=2),
    )


@_reader("qwen3_next", defaults={
    "head_dim": 256, "num_key_value_heads": 2, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "max_position_embeddings": 32768,
})
def _qwen3_next(config: _Config) -> list[ModelLayer]:
    """Every ``full_attention_interval``-th layer is full attention, the others Gated DeltaNet."""
    interval = config.integer("full_attention_interval")
    num_layers = config.integer("num_hidden_layers")
    return _from_layer_types(
        config,
        ["linear_attention" if (index + 1) % interval else "full_attention" for index in range(num_layers)],
    )


@_reader("nemotron_h", defaults={
    "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
    "conv_kernel": 4, "num_key_value_heads": 8,
})
def _nemotron_h(config: _Config) -> list[ModelLayer]:
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


@_reader("nemotron-nas", "deci", "decilm")
def _nemotron_nas(config: _Config) -> list[ModelLayer]:
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


@_reader("llama4", "llama4_text", defaults={
    "head_dim": 128, "num_key_value_heads": 8, "attention_chunk_size": 8192, "no_rope_layer_interval": 4,
    "max_position_embeddings": 131072,
})
def _llama4(config: _Config) -> list[ModelLayer]:
    """Chunked local attention on RoPE layers; NoPE layers (every 4th by default) are global."""
    num_layers = config.integer("num_hidden_layers")
    rope_flags = config.get("no_rope_layers")
    if not rope_flags:  # empty or missing: a NoPE layer every no_rope_layer_interval layers
        interval = config.integer("no_rope_layer_interval")
        rope_flags = [int((index + 1) % interval != 0) for index in range(num_layers)]
    chunk = config.get("attention_chunk_size")
    return _from_layer_types(
        config, ["chunked_attention" if flag and chunk else "full_attention" for flag in rope_flags]
    )


def _unwrap(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """The text model's config (multimodal configs nest it in ``text_config``) and the dtype."""
    dtype = config.get("torch_dtype") or config.get("dtype")
    text = config.get("text_config")
    if isinstance(text, Mapping) and text:
        return text, text.get("torch_dtype") or text.get("dtype") or dtype
    return config, dtype


def model_spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """The per-layer caches of the model a ``config.json`` dict describes."""
    if not isinstance(config, Mapping):
        raise ModelConfigError(f"a model config must be a JSON object, got {type(config).__name__}")
    inner, torch_dtype = _unwrap(config)
    model_type = str(inner.get("model_type") or config.get("model_type") or "")
    warnings: list[str] = []
    entry = _READERS.get(model_type)
    if entry is None and inner.get("kv_lora_rank") is not None:
        entry = _READERS["deepseek_v3"]
    if entry is None:
        missing = [name for name in _GENERIC_FIELDS if inner.get(name) is None]
        if missing:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported and the config lacks {missing} to read it "
                f"as llama-like; supported model types: {', '.join(supported_model_types())}"
            )
        message = f"model_type {model_type!r} is not known; reading it as llama-like"
        logger.warning(message)
        warnings.append(message)
        entry = _READERS["llama"]
    reader, defaults = entry
    wrapped = _Config(inner, model_type, defaults)
    layer_types = inner.get("layer_types")
    if isinstance(layer_types, list) and model_type not in ("nemotron_h",):
        layers = _from_layer_types(wrapped, layer_types)
    else:
        layers = reader(wrapped)
    if not layers:
        raise ModelConfigError(f"config (model_type {model_type!r}) describes no layers")
    if torch_dtype is None:
        message = "config has no torch_dtype; assuming bfloat16"
        logger.warning(message)
        warnings.append(message)
        torch_dtype = "bfloat16"
    max_positions = wrapped.get("max_position_embeddings")
    return ModelSpec(
        model_type=model_type or "unknown",
        layers=tuple(layers),
        torch_dtype=str(torch_dtype),
        max_position_embeddings=max_positions if isinstance(max_positions, int) else None,
        warnings=tuple(warnings),
    )
