"""Tiny random-weight transformers models, built from configs written here (no download): one per
model type that prefix reuse supports, 4-6 layers, float32, eager attention."""

from __future__ import annotations

from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
    # A wider weight scale than the default 0.02 makes logits, windows and states matter in tiny models.
    initializer_range=0.1,
)
WINDOW = 16  # sliding windows shorter than the test prompts
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16)
LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4)
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)

# model type -> config fields beyond BASE (None removes a BASE field)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2,
                  layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    "qwen3": {},
    "qwen3_moe": dict(**MOE, decoder_sparse_step=1),
    "phi3": dict(head_dim=None),
    "olmo2": {},
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, head_dim=None),
    "qwen3_next": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], **LINEAR, **MOE,
                       shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], **LINEAR),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], **LINEAR, **MOE,
                             shared_expert_intermediate_size=32),
    "bamba": dict(attn_layer_indices=[1, 3], **MAMBA2),
    "falcon_h1": dict(mamba_d_ssm=128, **MAMBA2),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                                          "full_attention"],
                       ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=1, conv_kernel=4, expand=2,
                       chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, num_hidden_layers=6),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=64, **MAMBA2),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=16, attention_head_dim=16,
                   use_mamba_kernels=False, adapter_rank=8, head_dim=None),
    "mamba2": dict(num_heads=4, head_dim=32, state_size=16, expand=2, conv_kernel=4, n_groups=1, chunk_size=16,
                   num_attention_heads=None, num_key_value_heads=None, intermediate_size=None),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                 block_auto_adjust_ff_dim=False, block_multiple_of=16),
    # Keys of 24 dims, values of 16 (MiMo-V2-Flash's 192 / 128): held unpadded, sliding layers with twice the heads.
    "mimo_v2_flash": dict(head_dim=24, v_head_dim=16, sliding_window=WINDOW + 1,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                          mlp_layer_types=["dense"] * 4, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32),
    # Refused: continuing its mamba (v1) layers from a restored state differs from recomputing.
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                  use_mamba_kernels=False, head_dim=None),
}


def config(model_type: str, **changes: Any) -> Any:
    from transformers import AutoConfig

    fields = {**BASE, **CONFIGS[model_type], **changes}
    return AutoConfig.for_model(model_type, **{name: value for name, value in fields.items() if value is not None})


def tiny_model(model_type: str, *, seed: int = 0, attention: str = "eager", **changes: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(model_type, **changes), attn_implementation=attention,
                                             dtype=torch.float32)
    return model.eval()
