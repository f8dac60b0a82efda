"""Tiny configs for every causal-LM model type of transformers: a generic set filtered by the config
class's fields, per-type overrides (``OVERRIDES``, passed as-is) and sub-config handling for composite
configs, at two sizes (``size`` "a" and "b": other head counts, head sizes, windows and state sizes, so
that a reader that hard-codes a number is caught at one of them).

Found by building every type (the research behind issue 20): unknown kwargs are accepted by
``AutoConfig.for_model`` and become stray attributes that some modeling code reads, so the generic
set is filtered by the fields the class declares; the overrides say why where it is not obvious.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Generic values, applied to a config class only where it declares the field.
GENERIC: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, initializer_range=0.1,
    # sliding windows shorter than the test prompts
    sliding_window=16,
    # GPT-style names
    n_embd=64, n_layer=4, n_head=4, n_positions=512, n_inner=128, n_ctx=512,
    # encoder-decoder style names
    d_model=64, decoder_layers=4, decoder_attention_heads=4, decoder_ffn_dim=128, encoder_layers=2,
    encoder_attention_heads=4, encoder_ffn_dim=128, ffn_dim=128, max_target_positions=512, max_source_positions=64,
    num_layers=4, num_heads=4, n_layers=4, n_heads=4, attention_heads=4, dff=128, d_inner=128, d_head=16,
    max_seq_len=512, emb_dim=64,
    # MoE
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, shared_expert_intermediate_size=32, first_k_dense_replace=1,
    moe_num_experts=4, moe_topk=2, moe_k=2, num_shared_experts=1, moe_num_shared_experts=1,
    shared_intermediate_size=32, moe_shared_expert_intermediate_size=32, expert_ffn_hidden_size=32,
    # MLA
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    # sparse attention indexers
    index_head_dim=16, index_n_heads=2, index_topk=8,
    # linear attention (gated DeltaNet and kin)
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4,
    # mamba-ish
    mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=16,
    # multi-token prediction off
    num_mtp_layers=0, num_nextn_predict_layers=0,
)

# Size "b": other head counts, head sizes, windows and state sizes on top of GENERIC.
SIZE_B: dict[str, Any] = dict(
    hidden_size=96, intermediate_size=160, num_key_value_heads=1, head_dim=24, sliding_window=12,
    n_embd=96, n_inner=160, d_model=96, d_head=24, emb_dim=96, decoder_ffn_dim=160, ffn_dim=160, dff=160, d_inner=160,
    kv_lora_rank=24, q_lora_rank=40, qk_rope_head_dim=4, v_head_dim=12, qk_nope_head_dim=12,
    index_head_dim=8, linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=1, linear_num_value_heads=2,
    mamba_n_heads=6, mamba_d_head=32, mamba_d_state=8, mamba_d_conv=3,
)

# Vision / audio towers: as small as their classes allow.
SUB_GENERIC: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    depth=1, num_heads=2, embed_dim=32, head_dim=16, initializer_range=0.1,
)

# model type -> config kwargs passed as-is (after GENERIC); None drops a GENERIC field.
WINDOW = 16
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16)
OVERRIDES: dict[str, dict[str, Any]] = {
    # Every kind of layer, and ratios that complete windows in the sweep's prompts: CSA's 4 divides its chunks of 8
    # tokens, HCA's 16 does not (a window spans two chunks: restored from the boundary's buffer).
    "deepseek_v4": dict(layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                     "compressed_sparse_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}),
    # --- from tests/support/tiny_models.py (verified types) ---
    "qwen2": dict(use_sliding_window=True, max_window_layers=2,
                  layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"]),
    "gemma2": dict(query_pre_attn_scalar=16),
    # Values of their own head size (MiMo-V2-Flash's 192 / 128): reuse verified with the pair unpadded.
    "mimo_v2_flash": dict(v_head_dim=8),
    "gemma3_text": dict(query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "phi3": dict(head_dim=None),
    "qwen3_next": dict(layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "bamba": dict(attn_layer_indices=[1, 3]),
    "falcon_h1": dict(mamba_d_ssm=128),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention",
                                          "full_attention"],
                       ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=32, n_groups=1, conv_kernel=4, expand=2,
                       chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, num_hidden_layers=6),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"], shared_intermediate_size=64),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=16, attention_head_dim=16,
                   use_mamba_kernels=False, adapter_rank=8, head_dim=None, layer_types=None),
    "mamba2": dict(num_heads=4, head_dim=32, state_size=16, expand=2, conv_kernel=4, n_groups=1, chunk_size=16,
                   num_attention_heads=None, num_key_value_heads=None, intermediate_size=None),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=3,
                 block_auto_adjust_ff_dim=False, block_multiple_of=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False, head_dim=None),
    # --- new ---
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=WINDOW),
    "cohere_compass_text": dict(
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "dory": dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "dots3_note_text": dict(num_key_value_heads=4, index_topk=8, swa_num_attention_heads=4, swa_num_key_value_heads=4,
                            swa_q_lora_rank=48, swa_kv_lora_rank=32, swa_head_dim=24, swa_qk_nope_head_dim=16,
                            swa_v_head_dim=16, shared_experts_intermediate_size=32),
    # transformers 5.25 validates that the indexer's heads fit in one key head's query heads (4 / 2 here).
    # Five layers, so that one is an indexed-attention layer (every fifth is).
    "kolibri1_1": dict(index_num_heads=2, num_hidden_layers=5),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1),
    "gemma3n_text": dict(num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2,
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=256, laurel_rank=8,
                         altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4, query_pre_attn_scalar=16),
    "gemma4_text": dict(global_head_dim=32, num_global_key_value_heads=1, num_kv_shared_layers=2,
                        layer_types=["sliding_attention", "full_attention"] * 2,
                        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256),
    "gemma4_unified_text": dict(global_head_dim=32, num_global_key_value_heads=1, num_kv_shared_layers=2,
                                layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "zaya": dict(num_experts_per_tok=1),
    "xlstm": dict(embedding_dim=64, num_blocks=4, num_heads=4, qk_dim_factor=1.0, v_dim_factor=1.0),
    "reformer": dict(is_decoder=True, attn_layers=["local", "lsh", "local", "lsh"], axial_pos_shape=[16, 32],
                     axial_pos_embds_dim=[32, 32], attention_head_size=16, feed_forward_size=128,
                     local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4, max_position_embeddings=512),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4, hc_lowrank=8, ngram_vocab_size_base=512,
                           make_ngram_vocab_size_divisible_by=16, split_ngram_parts=4, heads_per_ngram=2,
                           ple_layer_ids=[1]),
    "bart": dict(encoder_layers=4), "bigbird_pegasus": dict(encoder_layers=4, attention_type="original_full"),
    "blenderbot": dict(encoder_layers=4), "blenderbot-small": dict(encoder_layers=4), "marian": dict(encoder_layers=4),
    "mbart": dict(encoder_layers=4), "mvp": dict(encoder_layers=4), "pegasus": dict(encoder_layers=4),
    "plbart": dict(encoder_layers=4), "whisper": dict(encoder_layers=4),
    # encoder-style models used as decoders: a causal LM checkpoint sets is_decoder=True
    **{t: dict(is_decoder=True) for t in ("bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie",
                                          "roberta", "roberta-prelayernorm", "roc_bert", "xlm-roberta",
                                          "xlm-roberta-xl", "xmod", "megatron-bert", "rembert", "roformer")},
    "big_bird": dict(attention_type="original_full", is_decoder=True),
    "inkling2_text": dict(unpadded_vocab_size=256, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, sliding_window_size=WINDOW),
    "inkling2_loop_text": dict(unpadded_vocab_size=256, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                               swa_head_dim=16, sliding_window_size=WINDOW, loop_layer_index_start=1,
                               loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=8,
                               n_layers_per_attn_res_block=1),
    "musicgen": dict(), "musicgen_melody": dict(),
    "kimi_linear": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_head_dim=16,
                        linear_num_heads=4),
    "inkling_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                         sliding_window_size=WINDOW),
    "llama4_text": dict(attention_chunk_size=WINDOW),
    "modernbert-decoder": dict(local_attention=2 * WINDOW),
    "recurrent_gemma": dict(attention_window_size=WINDOW, lru_width=64),
    "jetmoe": dict(kv_channels=16),
    "prophetnet": dict(num_decoder_layers=4, num_decoder_attention_heads=4, num_encoder_layers=4,
                       num_encoder_attention_heads=4),
    "bailing_hybrid": dict(layer_types=["linear_attention"] * 3 + ["full_attention"]),
    # a 500002-row hash embedding by default
    "blt": dict(encoder_hash_byte_group_vocab=1024),
}
# Size "b" overrides where a type's own override fixes a number that size "b" changes.
OVERRIDES_B: dict[str, dict[str, Any]] = {
    # NVFP4 rounding of its K/V needs a head size that is a multiple of 16; three indexed-attention layers, the
    # second and third reading the first's K/V (its default kv_source_layers)
    "kolibri1_1": dict(head_dim=32, num_hidden_layers=15),
    # a full-attention layer (its own heads and head size) beside the sliding ones
    **{model_type: dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding"])
       for model_type in ("inkling_text", "inkling2_text")},
    "deepseek_v4": dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}),
    # its rotary dims must fit the indexer's head
    "qwen4_exp_text": dict(indexer_head_dim=24),
    # differential attention splits the values over an even number of KV heads
    "diffllama": dict(num_key_value_heads=2),
    # mamba heads x head size = the mixer's width
    "falcon_h1": dict(mamba_d_ssm=192),
    "mamba2": dict(num_heads=6, head_dim=32, state_size=8, conv_kernel=3),
}
# composite types: their text_config gets the text type's overrides
TEXT_OF = {"gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "gemma4": "gemma4_text",
           "gemma4_unified": "gemma4_unified_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
           "qwen4_exp": "qwen4_exp_text", "dots3_note": "dots3_note_text", "llama4": "llama4_text"}

# model type -> {sub-config name: kwargs passed as-is on top of the sub-config's generic set}
SUB_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    # the default cross_attention_layers name layers beyond the 4 built
    "mllama": {"text_config": dict(cross_attention_layers=[3])},
    "musicgen": {"decoder": dict(num_codebooks=1, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                 num_attention_heads=4, vocab_size=256, max_position_embeddings=512)},
    "musicgen_melody": {"decoder": dict(num_codebooks=1, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                        num_attention_heads=4, vocab_size=256, max_position_embeddings=512)},
    "dots3_note": {"vision_config": dict(adapter_out_dim=64, adapter_in_dim=32, pyramid_num_routed=[-1]),
                   "audio_config": dict(adapter_out_dim=64, adapter_input_size=32)},
    "gemma4_assistant": {"text_config": dict(
        model_type="gemma4_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        num_kv_shared_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, initializer_range=0.1)},
    "gemma4_unified_assistant": {"text_config": dict(
        model_type="gemma4_unified_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        num_kv_shared_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
        initializer_range=0.1)},
}

# Size "b": sub-config kwargs that follow its other text hidden size.
SUB_OVERRIDES_B: dict[str, dict[str, dict[str, Any]]] = {
    "dots3_note": {"vision_config": dict(adapter_out_dim=96), "audio_config": dict(adapter_out_dim=96)},
}


def field_names(cls: type) -> set[str]:
    try:
        return {f.name for f in dataclasses.fields(cls)}
    except TypeError:
        import inspect

        return set(inspect.signature(cls.__init__).parameters)


def generic_for(cls: type, generic: dict[str, Any]) -> dict[str, Any]:
    names = field_names(cls)
    return {name: value for name, value in generic.items() if name in names}


def _mla_rule(cls: type, kwargs: dict[str, Any], generic: dict[str, Any]) -> None:
    """MLA: one K/V head per query head, and head_dim is the rope part (longcat's interleaved rope)."""
    names = field_names(cls)
    if "kv_lora_rank" in names:
        kwargs["num_key_value_heads"] = generic["num_attention_heads"]
        if "head_dim" in names:
            kwargs["head_dim"] = generic["qk_rope_head_dim"]


def _apply(kwargs: dict[str, Any], overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if value is None:
            kwargs.pop(key, None)
        else:
            kwargs[key] = value


def _overrides(model_type: str, size: str) -> dict[str, Any]:
    return {**OVERRIDES.get(model_type, {}), **(OVERRIDES_B.get(model_type, {}) if size == "b" else {})}


def kwargs_for(model_type: str, size: str = "a") -> dict[str, Any]:
    """The kwargs given to ``AutoConfig.for_model`` (sub-configs as dicts) at one of the two sizes."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    generic = {**GENERIC, **SIZE_B} if size == "b" else GENERIC
    cls = CONFIG_MAPPING[model_type]
    kwargs = generic_for(cls, generic)
    _mla_rule(cls, kwargs, generic)
    subs = dict(getattr(cls, "sub_configs", {}) or {})
    sub_over = {name: {**fields, **(SUB_OVERRIDES_B.get(model_type, {}).get(name, {}) if size == "b" else {})}
                for name, fields in SUB_OVERRIDES.get(model_type, {}).items()}
    if subs:
        # Each sub-config's class from a default instance (AutoConfig sub-configs have a default type).
        try:
            default = cls()
        except Exception:
            default = None
        for name, sub_cls in subs.items():
            instance = getattr(default, name, None) if default is not None else None
            real_cls = type(instance) if instance is not None and not isinstance(instance, dict) else sub_cls
            if getattr(real_cls, "__name__", "") == "AutoConfig":
                if name in sub_over:
                    kwargs[name] = dict(sub_over[name])
                continue
            textual = name in ("text_config", "decoder", "global_config", "depth_decoder_config")
            sub_kwargs = generic_for(real_cls, generic if textual else SUB_GENERIC)
            if name == "text_config":
                _mla_rule(real_cls, sub_kwargs, generic)
                if model_type in TEXT_OF:
                    _apply(sub_kwargs, _overrides(TEXT_OF[model_type], size))
            sub_kwargs.update(sub_over.get(name, {}))
            if getattr(real_cls, "model_type", None):
                sub_kwargs["model_type"] = real_cls.model_type
            kwargs[name] = sub_kwargs
    _apply(kwargs, _overrides(model_type, size))
    return kwargs


# types whose causal LM is built from a sub-config (AutoModelForCausalLM maps the composite type to a decoder class)
BUILD_FROM_SUB = {"musicgen": "decoder", "musicgen_melody": "decoder"}


# What a built model needs before its first forward.
AFTER_BUILD = {"xmod": lambda model: model.set_default_language("en_XX")}


def build_config(model_type: str, size: str = "a") -> Any:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **kwargs_for(model_type, size))
    if model_type in BUILD_FROM_SUB:
        config = getattr(config, BUILD_FROM_SUB[model_type])
    return config
