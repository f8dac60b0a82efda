"""The models the reuse benchmarks share: random-weight, sized for a CPU, built from a fixed seed.

``LLAMA_LIKE`` is the model of ``integrations.transformers.reuse`` and of ``integrations.vllm.reuse`` /
``integrations.vllm.serving`` (vLLM's CPU engine): 8 layers, hidden 1024, 16 heads, 8 KV heads, vocab 32000,
32 KiB of float32 K/V per token. ``QWEN3_NEXT_LIKE`` is ``integrations.vllm.serving``'s hybrid (gated DeltaNet
and full attention). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

LLAMA_LIKE: dict[str, Any] = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                                  tie_word_embeddings=False)
GEMMA3_LIKE: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, sliding_window=1024, max_position_embeddings=8192,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
)


# A qwen3-next-like hybrid for vLLM's CPU engine (bfloat16, which its gated-DeltaNet kernels take, with
# linear heads of 128): 8 layers, 6 gated DeltaNet and 2 full attention (4 KV heads x 128), 4 experts.
QWEN3_NEXT_LIKE: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    head_dim=128, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=4, linear_num_value_heads=8, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=2048,
    max_position_embeddings=8192, tie_word_embeddings=False,
)


def build(model_type: str, fields: dict[str, Any]) -> Any:
    """A float32 transformers model of ``model_type`` with ``fields``, weights drawn from seed 0."""
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                         dtype=torch.float32).eval()


def llama_like() -> Any:
    return build("llama", LLAMA_LIKE)


def gemma3_like() -> Any:
    return build("gemma3_text", GEMMA3_LIKE)


def save_llama_like(directory: Path) -> None:
    """``LLAMA_LIKE`` as a local model directory (safetensors) for an engine to load."""
    llama_like().save_pretrained(directory, safe_serialization=True)


def save_qwen3_next_like(directory: Path) -> None:
    """``QWEN3_NEXT_LIKE`` in bfloat16 as a local model directory for vLLM's CPU engine."""
    build("qwen3_next", QWEN3_NEXT_LIKE).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
