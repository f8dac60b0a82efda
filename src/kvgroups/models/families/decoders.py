"""Attention-only decoders that keep keys and values in every layer, read the standard way: every
layer alike (``num_key_value_heads`` x ``head_dim``, else ``num_attention_heads`` x ``hidden_size /
num_attention_heads``), a ``layer_types`` list where the config carries one, and a window on every
layer where ``sliding_window`` is set (Mistral's rule).

Most families need only their ``transformers`` config class's defaults (a config that omits a
field is read as transformers builds it); older ones spell the standard fields their own way
(GPT-2's ``n_layer``, a standalone decoder's ``decoder_layers``), named in their ``aliases``.
``tests/models/test_model_configs.py`` checks the defaults against the installed config classes, and the
sweep (``tests/models/test_model_type_sweep.py``) every family against the cache its model keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgroups.core.cache_specs import FullAttention
from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import GENERIC_FIELDS, ConfigFields, family
from kvgroups.models.families.attention import uniform_layers
from kvgroups.models.layers import AttentionLayer, ModelLayer


def _every_layer(config: ConfigFields) -> list[ModelLayer]:
    """Every layer alike; all of them slide where a window applies."""
    return uniform_layers(config, first_sliding=0)


def _defaults(layers: int, heads: int, hidden: int, positions: int | None = None, **more: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": hidden, **more}
    if positions is not None:
        found["max_position_embeddings"] = positions
    return found


# model_type -> transformers' defaults (layers, heads, hidden, positions, and kv heads / head_dim where the
# class sets them).
_STANDARD: Mapping[str, Mapping[str, Any]] = {
    "apertus": _defaults(32, 32, 4096, 65536), "apertus1p5_text": _defaults(32, 32, 4096, 65536),
    "arcee": _defaults(32, 32, 2560, 4096), "aria_text": _defaults(32, 32, 4096, 2048),
    "bitnet": _defaults(30, 20, 2560, 2048, num_key_value_heads=5), "cohere": _defaults(40, 64, 8192, 8192),
    "diffllama": _defaults(16, 32, 2048, 2048), "emu3_text_model": _defaults(32, 32, 4096, 9216, num_key_value_heads=8),
    "ernie4_5": _defaults(18, 16, 1024, 131072, num_key_value_heads=2, head_dim=128),
    "ernie4_5_moe": _defaults(28, 20, 2560, 131072, num_key_value_heads=4),
    "flex_olmo": _defaults(32, 32, 4096, 4096),
    "gemma": _defaults(28, 16, 3072, 8192, num_key_value_heads=16, head_dim=256),
    "glm": _defaults(40, 32, 4096, 131072, num_key_value_heads=2, head_dim=128),
    "glm4": _defaults(40, 32, 4096, 131072, num_key_value_heads=2, head_dim=128),
    "glm4_moe": _defaults(46, 96, 4096, 131072, num_key_value_heads=8),
    "granite": _defaults(32, 32, 4096, 2048), "granitemoe": _defaults(32, 32, 4096, 2048),
    "granitemoeshared": _defaults(32, 32, 4096, 2048),
    "helium": _defaults(24, 20, 2560, 4096, num_key_value_heads=20, head_dim=128),
    "hunyuan_v1_dense": _defaults(32, 32, 4096, 2048), "hunyuan_v1_moe": _defaults(32, 32, 4096, 2048),
    "hy_v3": _defaults(80, 64, 4096, 131072, num_key_value_heads=8, head_dim=128),
    "hyperclovax": _defaults(32, 32, 4096, 2048),
    "internlm3": _defaults(48, 32, 4096, 32768, num_key_value_heads=2, head_dim=128),
    "iquestcoder": _defaults(80, 40, 5120, 131072, num_key_value_heads=8, head_dim=128),
    "jais2": _defaults(32, 26, 3328, 8192),
    "minimax_m2": _defaults(62, 48, 3072, 196608, num_key_value_heads=8, head_dim=128),
    "minicpm5_moe": _defaults(28, 32, 2048, 524288, num_key_value_heads=2, head_dim=128),
    "param2moe": _defaults(21, 32, 2048, 32768, num_key_value_heads=8, head_dim=64),
    "nanochat": _defaults(12, 6, 768, 2048), "nemotron": _defaults(32, 48, 6144, 4096),
    "olmo": _defaults(32, 32, 4096, 2048), "olmo2": _defaults(32, 32, 4096, 2048),
    "olmoe": _defaults(16, 16, 2048, 4096), "opt": _defaults(12, 12, 768, 2048),
    "persimmon": _defaults(36, 64, 4096, 16384), "phi": _defaults(24, 32, 2048, 2048),
    "sarvam_moe": _defaults(19, 64, 4096, 131072, num_key_value_heads=4, head_dim=64),
    "seed_oss": _defaults(64, 80, 4096, 524288, num_key_value_heads=8, head_dim=128),
    "solar_open": _defaults(48, 64, 4096, 131072, num_key_value_heads=8, head_dim=128),
    "stablelm": _defaults(32, 32, 2560, 4096, num_key_value_heads=32), "biogpt": _defaults(24, 16, 1024, 1024),
    "gpt_neox": _defaults(44, 64, 6144, 2048), "gpt_neox_japanese": _defaults(32, 32, 2560, 2048),
    "git": _defaults(6, 12, 768, 1024), "moshi": _defaults(32, 32, 4096, 3000, sliding_window=3000),
    "starcoder2": _defaults(30, 24, 3072, 4096, num_key_value_heads=2),
    "ministral3": _defaults(34, 32, 4096, 262144, num_key_value_heads=8, head_dim=128),
    "phimoe": _defaults(32, 32, 4096, 131072, num_key_value_heads=8),
    "phi4_multimodal": _defaults(32, 32, 3072, 131072, num_key_value_heads=8), "doge": _defaults(32, 8, 1024, 2048),
    "musicgen_decoder": _defaults(24, 16, 1024, 2048), "musicgen_melody_decoder": _defaults(24, 16, 1024, 2048),
}
for _model_type, _found in _STANDARD.items():
    family(_model_type, defaults=_found)(_every_layer)
# EXAONE 3's published configs name the layer count num_layers (transformers maps it to num_hidden_layers).
family("exaone", defaults=_defaults(32, 32, 4096, 4096, num_key_value_heads=8),
       aliases={"num_hidden_layers": "num_layers"})(_every_layer)

# Encoder models built as decoders (``is_decoder: true``) keep a K/V cache per layer.
_AS_DECODERS: Mapping[str, Mapping[str, Any]] = {
    "bert": _defaults(12, 12, 768, 512), "bert-generation": _defaults(24, 16, 1024, 512),
    "big_bird": _defaults(12, 12, 768, 4096), "camembert": _defaults(12, 12, 768, 512),
    "data2vec-text": _defaults(12, 12, 768, 512), "electra": _defaults(12, 4, 256, 512),
    "ernie": _defaults(12, 12, 768, 512), "megatron-bert": _defaults(24, 16, 1024, 512),
    "rembert": _defaults(32, 18, 1152, 512), "roberta": _defaults(12, 12, 768, 512),
    "roberta-prelayernorm": _defaults(12, 12, 768, 512), "roc_bert": _defaults(12, 12, 768, 512),
    "roformer": _defaults(12, 12, 768, 1536), "xlm-roberta": _defaults(12, 12, 768, 512),
    "xlm-roberta-xl": _defaults(36, 32, 2560, 514), "xmod": _defaults(12, 12, 768, 512),
}


def _as_decoder(config: ConfigFields) -> list[ModelLayer]:
    """Only a config built as a decoder caches: an encoder attends both ways and keeps nothing."""
    if config.get("is_decoder") is not True:
        raise ModelConfigError(f"model_type {config.model_type!r} with is_decoder false is an encoder: it keeps no "
                               f"KV cache (a causal LM checkpoint sets is_decoder true)")
    return _every_layer(config)


for _model_type, _found in _AS_DECODERS.items():
    family(_model_type, defaults=_found)(_as_decoder)

_GPT2_NAMES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
               "max_position_embeddings": "n_positions"}
_DECODER_NAMES = {"hidden_size": "d_model", "num_attention_heads": "decoder_attention_heads",
                  "num_hidden_layers": "decoder_layers"}
# Standalone decoders of encoder-decoder families: transformers' ``num_hidden_layers`` is the encoder's.
_DECODERS: Mapping[str, Mapping[str, Any]] = {
    "bart": _defaults(12, 16, 1024, 1024), "mbart": _defaults(12, 16, 1024, 1024),
    "marian": _defaults(12, 16, 1024, 1024), "pegasus": _defaults(12, 16, 1024, 1024),
    "plbart": _defaults(6, 12, 768, 1024), "mvp": _defaults(12, 16, 1024, 1024),
    "blenderbot": _defaults(24, 32, 2560, 128), "blenderbot-small": _defaults(8, 16, 512, 512),
    "bigbird_pegasus": _defaults(16, 16, 1024, 4096), "trocr": _defaults(12, 16, 1024, 512),
}
for _model_type, _found in _DECODERS.items():
    family(_model_type, defaults=_found, aliases=_DECODER_NAMES)(_every_layer)
family("whisper", defaults=_defaults(4, 6, 384, 448), aliases={
    **_DECODER_NAMES, "max_position_embeddings": "max_target_positions"})(_every_layer)
family("prophetnet", defaults=_defaults(12, 16, 1024, 512), aliases={
    "num_attention_heads": "num_decoder_attention_heads", "num_hidden_layers": "num_decoder_layers"})(_every_layer)
family("xglm", defaults=_defaults(24, 16, 1024, 2048), aliases={
    "hidden_size": "d_model", "num_attention_heads": "attention_heads", "num_hidden_layers": "num_layers",
})(_every_layer)
for _model_type, _found in {"gpt2": _defaults(12, 12, 768, 1024), "gpt-sw3": _defaults(12, 12, 768, 1024),
                            "ctrl": _defaults(48, 16, 1280, 256), "gptj": _defaults(28, 16, 4096, 2048),
                            "codegen": _defaults(28, 16, 4096, 2048)}.items():
    family(_model_type, defaults=_found, aliases=_GPT2_NAMES)(_every_layer)
family("bloom", defaults=_defaults(2, 8, 64), aliases={
    "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"})(_every_layer)
# gpt-neo's "local" layers only mask: the cache keeps every token (transformers and vLLM alike).
family("gpt_neo", defaults=_defaults(24, 16, 2048, 2048), aliases={
    "num_attention_heads": "num_heads", "num_hidden_layers": "num_layers"})(_every_layer)
family("mpt", defaults=_defaults(24, 16, 2048, 2048), aliases={
    "hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
    "max_position_embeddings": "max_seq_len"})(_every_layer)


@family("gpt_bigcode", defaults={**_defaults(12, 12, 768, 1024), "multi_query": True}, aliases=_GPT2_NAMES)
def _gpt_bigcode(config: ConfigFields) -> list[ModelLayer]:
    """One K/V head under ``multi_query`` (the default), else one per query head."""
    heads = 1 if config.get("multi_query") else config.integer("num_attention_heads")
    return _with_heads(config, heads, config.head_size())


@family("falcon", defaults={**_defaults(32, 71, 4544, 2048), "multi_query": True,
                            "new_decoder_architecture": False})
def _falcon(config: ConfigFields) -> list[ModelLayer]:
    """``num_kv_heads`` (default every query head) in the new decoder architecture or without
    ``multi_query``; one K/V head under ``multi_query`` in the old one (FalconAttention's rule)."""
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        heads = 1
    elif config.get("num_kv_heads") is not None:
        heads = config.integer("num_kv_heads")
    else:
        heads = config.integer("num_attention_heads")
    return _with_heads(config, heads, config.head_size())


@family("dbrx", defaults=_defaults(24, 16, 2048, 2048), aliases={
    "hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
    "max_position_embeddings": "max_seq_len"})
def _dbrx(config: ConfigFields) -> list[ModelLayer]:
    """K/V heads from ``attn_config.kv_n_heads`` (transformers' default 1)."""
    attention = config.get("attn_config") or {}
    if not isinstance(attention, Mapping):
        raise ModelConfigError(f"dbrx attn_config must be a mapping, got {attention!r}")
    heads = attention.get("kv_n_heads", 1)
    if not isinstance(heads, int) or heads < 1:
        raise ModelConfigError(f"dbrx attn_config.kv_n_heads must be a positive int, got {heads!r}")
    return _with_heads(config, heads, config.head_size())


@family("jetmoe", defaults={**_defaults(12, 32, 2048, 4096), "num_key_value_heads": 16, "head_dim": 128},
        aliases={"head_dim": "kv_channels"})
def _jetmoe(config: ConfigFields) -> list[ModelLayer]:
    """``num_key_value_heads`` heads of ``kv_channels`` (its head size)."""
    return _with_heads(config, config.integer("num_key_value_heads"), config.integer("head_dim"))


@family("cpmant", defaults={**_defaults(48, 32, 4096), "dim_head": 128})
def _cpmant(config: ConfigFields) -> list[ModelLayer]:
    """Every query head keeps its own K/V of ``dim_head``."""
    return _with_heads(config, config.integer("num_attention_heads"), config.integer("dim_head"))


@family("hrm_text", defaults={**_defaults(16, 12, 1536, 2048, head_dim=128), "H_cycles": 2, "L_cycles": 3})
def _hrm_text(config: ConfigFields) -> list[ModelLayer]:
    """One cache per attention pass: ``num_layers_per_stack * H_cycles * (L_cycles + 1)`` of them. A
    config saved by transformers holds that count in ``num_hidden_layers`` beside ``num_layers_per_stack``;
    one without ``num_layers_per_stack`` holds the per-stack count, which transformers multiplies out."""
    layers = config.integer("num_hidden_layers")
    if config.get("num_layers_per_stack") is None:
        layers *= config.integer("H_cycles") * (config.integer("L_cycles") + 1)
    return [config.attention(FullAttention())] * layers


def _sparse_m3(config: ConfigFields) -> ModelLayer:
    raise ModelConfigError("minimax_m3_sparse layers keep block-sparse index keys beside their K/V, which no "
                           "reader here describes; refusing to guess")


@family("minimax_m3_vl_text", defaults=_defaults(60, 64, 6144, 524288, num_key_value_heads=4, head_dim=128),
        layer_types={"minimax_m3_sparse": _sparse_m3},
        # The index_* fields configure minimax_m3_sparse layers only; transformers writes them into every config.
        reads=("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_local_blocks"))
def _minimax_m3(config: ConfigFields) -> list[ModelLayer]:
    """Full attention everywhere unless ``sparse_attention_config.sparse_attention_freq`` names sparse layers."""
    sparse = (config.get("sparse_attention_config") or {}).get("sparse_attention_freq") or []
    if any(sparse):
        return [_sparse_m3(config)]
    return _every_layer(config)


def _with_heads(config: ConfigFields, heads: int, head_size: int) -> list[ModelLayer]:
    config.require(*GENERIC_FIELDS)
    return [AttentionLayer(spec=FullAttention(), num_kv_heads=heads, head_size=head_size)
            for _ in range(config.integer("num_hidden_layers"))]
