"""Multi-head latent attention families (DeepSeek V2/V3, Kimi K2): one latent per token; and the
sparse-attention (DSA) ones (DeepSeek-V3.2, GLM-5) whose indexer keeps a key per token as well."""

from __future__ import annotations

from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family
from kvgroups.models.layers import (
    IndexedMLALayer,
    MLALayer,
    ModelLayer,
)

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
_DSA_FIELDS = (*_MLA_FIELDS, "index_head_dim", "index_n_heads", "index_topk", "index_topk_freq",
               "index_topk_pattern", "index_skip_topk_offset", "indexer_types")


@family("deepseek_v2", "deepseek_v3", "kimi_k2", reads=_MLA_FIELDS)
def _mla(config: ConfigFields) -> list[ModelLayer]:
    """Multi-head latent attention on every layer (MTP layers are not counted)."""
    layer = MLALayer(kv_lora_rank=config.integer("kv_lora_rank"), qk_rope_head_dim=config.integer("qk_rope_head_dim"))
    return [layer] * config.integer("num_hidden_layers")


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
