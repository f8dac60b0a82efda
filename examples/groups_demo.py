"""Build layer groups for three model shapes on the meta device and print their chunk shapes.

Llama-3.1-8B-like (32 full-attention layers), gpt-oss-20b-like (24 layers alternating
sliding(128)/full) and DeepSeek-V3-like (61 MLA layers). Nothing is allocated.
"""

from __future__ import annotations

import torch

from kvgroups import FullAttention, LayerCacheSpec, LMCacheMetadata, SlidingWindow

NUM_BLOCKS, BLOCK_SIZE = 4096, 16


def kv_cache(num_kv_heads: int, head_size: int) -> torch.Tensor:
    """``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM FlashAttention)."""
    return torch.empty(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size, dtype=torch.bfloat16, device="meta")


def show(name: str, caches: dict[str, torch.Tensor], specs: dict[str, LayerCacheSpec], use_mla: bool) -> None:
    metadata = LMCacheMetadata(
        model_name=name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(len(caches), 1 if use_mla else 2, 256, 1, 1), use_mla=use_mla,
    )
    metadata.kv_layer_groups_manager.build_kv_layer_groups(caches, specs)
    print(f"{name}: {metadata.get_num_groups()} group(s), fingerprint {metadata.fingerprint()[:16]}")
    groups = metadata.kv_layer_groups_manager.kv_layer_groups
    for group, chunk_shape in zip(groups, metadata.get_shapes(), strict=True):
        print(f"  {group}\n    chunk shape {list(chunk_shape)}")


def main() -> None:
    show("llama-3.1-8b", {f"model.layers.{i}.self_attn.attn": kv_cache(8, 128) for i in range(32)}, {}, False)
    gpt_oss = {f"model.layers.{i}.self_attn.attn": kv_cache(8, 64) for i in range(24)}
    specs: dict[str, LayerCacheSpec] = {
        name: SlidingWindow(window_tokens=128) if i % 2 == 0 else FullAttention()
        for i, name in enumerate(gpt_oss)
    }
    show("gpt-oss-20b", gpt_oss, specs, False)
    latent = torch.empty(NUM_BLOCKS, BLOCK_SIZE, 576, dtype=torch.bfloat16, device="meta")
    deepseek = {f"model.layers.{i}.self_attn.attn": latent for i in range(61)}
    show("deepseek-v3", deepseek, {}, True)


if __name__ == "__main__":
    main()
