"""Multi-head latent attention families (DeepSeek V2/V3, Kimi K2): one latent per token; and the
sparse-attention (DSA) ones (DeepSeek-V3.2, GLM-5) whose indexer keeps a key per token as well; dots3, whose
sliding layers keep latents of their own size in a window."""

from __future__ import annotations

from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family, per_layer_entries
from kvgroups.models.layers import (
    IndexedMLALayer,
    MLALayer,
    ModelLayer,
    ParallelLayer,
)

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
_DSA_FIELDS = (*_MLA_FIELDS, "index_head_dim", "index_n_heads", "index_topk", "index_topk_freq",
               "index_topk_pattern", "index_skip_topk_offset", "indexer_types")


@family("deepseek_v2", "deepseek_v3", "kimi_k2", reads=_MLA_FIELDS)
def _mla(config: ConfigFields) -> list[ModelLayer]:
    """Multi-head latent attention on every layer (MTP layers are not counted)."""
    layer = MLALayer(kv_lora_rank=config.integer("kv_lora_rank"), qk_rope_head_dim=config.integer("qk_rope_head_dim"))
    return [layer] * config.integer("num_hidden_layers")


def _mla_defaults(layers: int, heads: int, hidden: int, positions: int, rank: int = 512,
                  rope: int = 64) -> dict[str, int]:
    return {"num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": hidden,
            "max_position_embeddings": positions, "kv_lora_rank": rank, "qk_rope_head_dim": rope}


# More MLA families (transformers' defaults): every layer one latent.
for _model_type, _defaults in {
    "axk1": _mla_defaults(61, 64, 7168, 32768), "glm4_moe_lite": _mla_defaults(47, 20, 2048, 202752),
    "minicpm3": _mla_defaults(62, 40, 2560, 32768, 256, 32), "sarvam_mla": _mla_defaults(32, 64, 4096, 4096),
    "youtu": _mla_defaults(32, 16, 2048, 131072),
}.items():
    family(_model_type, defaults=_defaults, reads=_MLA_FIELDS)(_mla)


@family("longcat_flash", defaults={**_mla_defaults(0, 64, 6144, 131072), "num_layers": 28}, reads=_MLA_FIELDS)
def _longcat_flash(config: ConfigFields) -> list[ModelLayer]:
    """``num_layers`` layers of two MLA attentions each, each with a latent cache of its own."""
    latent = MLALayer(kv_lora_rank=config.integer("kv_lora_rank"), qk_rope_head_dim=config.integer("qk_rope_head_dim"))
    return [ParallelLayer(mixers=(latent, latent))] * config.integer("num_layers")


def _indexer_types(config: ConfigFields, num_layers: int) -> list[str]:
    """Which layers run their own indexer (``full``) and which reuse the previous one's top-k (``shared``),
    as transformers' GlmMoeDsaConfig derives them."""
    explicit = config.get("indexer_types")
    pattern = config.get("index_topk_pattern")
    if explicit is None and isinstance(pattern, str):
        letters = {"F": "full", "S": "shared"}
        if set(pattern) - set(letters):
            raise ModelConfigError(f"index_topk_pattern must be made of F and S, got {pattern!r}")
        explicit = [letters[letter] for letter in pattern]
    elif explicit is None and pattern is not None:
        explicit = pattern
    if explicit is not None:
        if not isinstance(explicit, list) or len(explicit) != num_layers or set(explicit) - {"full", "shared"}:
            raise ModelConfigError(
                f"indexer_types must list 'full' or 'shared' for each of {num_layers} layers, got {explicit!r}"
            )
        return list(explicit)
    freq = config.integer("index_topk_freq")
    offset = config.integer("index_skip_topk_offset", minimum=0)
    return ["full" if max(index - offset + 1, 0) % freq == 0 else "shared" for index in range(num_layers)]


def _dsa(config: ConfigFields) -> list[ModelLayer]:
    """MLA plus a sparse-attention indexer with its own per-token key cache in every layer that runs one."""
    num_layers = config.integer("num_hidden_layers")
    kv_lora_rank, rope = config.integer("kv_lora_rank"), config.integer("qk_rope_head_dim")
    index_head_dim = config.integer("index_head_dim")
    return [
        IndexedMLALayer(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, index_head_dim=index_head_dim,
                        has_indexer=kind == "full")
        for kind in _indexer_types(config, num_layers)
    ]


# transformers' DeepseekV32Config / GlmMoeDsaConfig defaults.
_DSA_DEFAULTS = {"index_head_dim": 128, "index_topk": 2048, "index_topk_freq": 1, "index_skip_topk_offset": 2}
family("deepseek_v32", defaults={**_DSA_DEFAULTS, "index_n_heads": 64},
       reads=_DSA_FIELDS, reads_layer_types=False)(_dsa)
family("glm_moe_dsa", defaults={**_DSA_DEFAULTS, "index_n_heads": 32},
       reads=_DSA_FIELDS, reads_layer_types=False)(_dsa)
# AXK2: an indexer in every layer.
family("axk2", defaults={**_mla_defaults(48, 32, 2048, 131072, 128, 32), "index_head_dim": 128, "index_topk": 2048,
                         "index_topk_freq": 1, "index_skip_topk_offset": 0},
       reads=_DSA_FIELDS, reads_layer_types=False)(_dsa)


@family("hy_v4", defaults={**_mla_defaults(34, 32, 2816, 262144), "index_head_dim": 128, "index_topk": 2048},
        reads=_DSA_FIELDS, reads_layer_types=False)
def _hy_v4(config: ConfigFields) -> list[ModelLayer]:
    """``indexer_types``, else HYV4Config's default: layers 0, 1, 5, 9, ... run an indexer, the others
    reuse the previous one's top-k."""
    if config.get("indexer_types") is None:
        kinds = ["full" if index == 0 or (index - 1) % 4 == 0 else "shared"
                 for index in range(config.integer("num_hidden_layers"))]
        config = ConfigFields({**config.data, "indexer_types": kinds}, config.model_type, config.family,
                              outer=config.outer)
    return _dsa(config)


# dots3: indexed-attention layers (a latent and an indexer's keys), full-attention ones (a latent), and sliding
# ones whose latent (its own kv_lora_rank and qk_rope_head_dim, from per_layer_config) is kept for the window.
_DOTS3_LAYER_TYPES = ("indexed_attention", "full_attention", "sliding_attention")
# per_layer_config fields dots3 reads: the latent's sizes, and those that leave a latent as it is (the query's and
# the values' sizes, heads).
_DOTS3_PER_LAYER_READS = frozenset({"kv_lora_rank", "qk_rope_head_dim", "head_dim", "v_head_dim",
                                    "num_key_value_heads", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim"})


@family("dots3_note_text", reads_layer_types=False, reads_per_layer_config=True, reads=_DSA_FIELDS,
        defaults={**_mla_defaults(46, 128, 5120, 524288), "index_head_dim": 128, "index_n_heads": 64,
                  "index_topk": 2048, "sliding_window": 512})
def _dots3(config: ConfigFields) -> list[ModelLayer]:
    """``layer_types`` (else dots3's: indexed attention in layers 0, 1 and every 4th from 1, the others slide);
    a layer's latent sizes from its ``per_layer_config`` entry, else the config's."""
    count = config.integer("num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = [_DOTS3_LAYER_TYPES[0] if index < 2 or index % 4 == 1 else _DOTS3_LAYER_TYPES[2]
                       for index in range(count)]
    if not isinstance(layer_types, list) or len(layer_types) != count or set(layer_types) - set(_DOTS3_LAYER_TYPES):
        raise ModelConfigError(f"layer_types must list one of {', '.join(_DOTS3_LAYER_TYPES)} for each of {count} "
                               f"layers, got {layer_types!r}")
    overrides = {index: fields for index, _, fields in per_layer_entries(config, count, _DOTS3_PER_LAYER_READS)}
    window = config.sliding_window()
    layers: list[ModelLayer] = []
    for index, kind in enumerate(layer_types):
        fields = overrides.get(index, {})
        rank, rope = (fields.get(name, config.integer(name)) for name in ("kv_lora_rank", "qk_rope_head_dim"))
        if not all(isinstance(value, int) and value >= 1 for value in (rank, rope)):
            raise ModelConfigError(f"per_layer_config[{index}]: kv_lora_rank {rank!r}, qk_rope_head_dim {rope!r}; "
                                   f"expected positive ints")
        if kind == "indexed_attention":
            layers.append(IndexedMLALayer(kv_lora_rank=rank, qk_rope_head_dim=rope,
                                          index_head_dim=config.integer("index_head_dim")))
        else:
            layers.append(MLALayer(kv_lora_rank=rank, qk_rope_head_dim=rope,
                                   window_tokens=window if kind == "sliding_attention" else None))
    return layers
