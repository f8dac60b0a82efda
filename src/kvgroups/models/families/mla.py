"""Multi-head latent attention families (DeepSeek V2/V3, Kimi K2): one latent per token."""

from __future__ import annotations

from kvgroups.models.config_fields import ConfigFields, family
from kvgroups.models.layers import (
    MLALayer,
    ModelLayer,
)


@family("deepseek_v2", "deepseek_v3", "kimi_k2")
def _mla(config: ConfigFields) -> list[ModelLayer]:
    """Multi-head latent attention on every layer (MTP layers are not counted)."""
    layer = MLALayer(kv_lora_rank=config.integer("kv_lora_rank"), qk_rope_head_dim=config.integer("qk_rope_head_dim"))
    return [layer] * config.integer("num_hidden_layers")
