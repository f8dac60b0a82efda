"""Tiny random-weight models vLLM's CPU backend serves, saved with a word-level tokenizer (no download).

The CPU attention backend takes head sizes from a fixed list (32, 64, ...) and block sizes that are
multiples of 32; its gated-DeltaNet kernels take bfloat16 and linear head sizes of 128.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=3,
    tie_word_embeddings=False, initializer_range=0.1,
)


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS)}
    vocab.update({f"w{index}": len(SPECIALS) + index for index in range(VOCAB - len(SPECIALS))})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(directory)


def save_model(kind: str, directory: Path, **overrides: Any) -> Path:
    """Save a tiny ``kind`` ("llama", "gemma3", "qwen3_next" or "granite_hybrid") model to ``directory``."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 2, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**{
            **COMMON, "num_hidden_layers": 4, "sliding_window": 64, "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            **overrides,
        })
        model = transformers.Gemma3ForCausalLM(config)
    elif kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(**{
            **COMMON, "num_hidden_layers": 4, "head_dim": 64,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
            "torch_dtype": "bfloat16", **overrides,
        })
        model = transformers.Qwen3NextForCausalLM(config).to(torch.bfloat16)
    elif kind == "granite_hybrid":  # granite-4-like: Mamba-2 mixers and attention (its linear head size, 32)
        config = transformers.GraniteMoeHybridConfig(**{
            **COMMON, "num_hidden_layers": 4, "num_attention_heads": 2,
            "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 32,
            "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64,
            "num_local_experts": 0, "shared_intermediate_size": 128, "position_embedding_type": "rope", **overrides,
        })
        model = transformers.GraniteMoeHybridForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory
