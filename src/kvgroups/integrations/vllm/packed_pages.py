"""vLLM's DeepSeek-V4 caches, moved as whole pages: their bytes are packed by the backend.

vLLM 0.32-0.34 keep every DeepSeek-V4 cache in pages of their own block size, views into one block pool:
the window (``SlidingWindowMLASpec``, 64-token pages), the compressed rows and the indexer's keys
(``MLAAttentionSpec`` with ``tokens_per_state`` 4 or 128, 256-token pages), the compressors' float32
states (``SlidingWindowMLASpec``, 4- or 8-token pages). In ``fp8_ds_mla`` a page is its rows' fp8 and
bf16 values, then all of their scales: one token's bytes are not a row of the page. So each layer is
moved by page, one slot per block ``[num_blocks, 1, page_bytes]`` (its real bytes; the padding between
layers is no view's), and restored byte for byte:

- a compressed page is complete once its 256 tokens are: one slot per 256 tokens
  (``CompressedRows(tokens_per_row=256)``), every one of them needed by a prefix;
- a window's pages are needed only at the end of a prefix, as many as vLLM's sliding-window manager keeps
  for a hit there (``WindowPages``: 2 of the window's, 2 or 16 of the compressor states'); a stored chunk
  holds the last ones before its end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.row_specs import CompressedRows, window_pages
from kvgroups.errors import UnsupportedCacheError
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams, build_rank

# What marks a page packed by the backend: fields vLLM sets only for such pages.
_PACKED_FIELDS = ("state_content_bytes", "alignment", "model_version")


def packed_page_kind(name: str, spec: Any) -> LayerCacheSpec | None:
    """The kind a page-moved layer is stored as; None for a spec whose tokens are rows of its page."""
    kind = type(spec).__name__
    if kind == "SlidingWindowMLASpec":
        if getattr(spec, "bounded_replay", False):
            raise UnsupportedCacheError(f"layer {name!r}: SlidingWindowMLASpec with bounded_replay (DeepSeek-V4.1): "
                                        f"vLLM never prefix-caches it, replaying its window instead")
        return window_pages(int(spec.sliding_window), int(spec.block_size))
    if kind == "MLAAttentionSpec" and (int(getattr(spec, "tokens_per_state", 1)) != 1
                                       or any(getattr(spec, field, None) is not None for field in _PACKED_FIELDS)):
        return CompressedRows(tokens_per_row=int(spec.block_size))
    return None


def page_bytes(spec: Any) -> int:
    """One layer's real bytes in one block (what its view covers; the padding after it is not its)."""
    return int(spec.real_page_size_bytes)


def page_view(name: str, tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``[num_blocks, 1, rows, width]`` as vLLM registers a page-moved layer, viewed as ``[num_blocks, 1, size]``
    bytes (a view: its rows must be contiguous within the block)."""
    if tensor.dim() != 4 or tensor.shape[1] != 1:
        raise UnsupportedCacheError(f"layer {name!r}: vLLM registered {list(tensor.shape)}; expected "
                                    f"[num_blocks, 1, rows, width]")
    pages = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    try:
        viewed = pages.view(pages.shape[0], 1, -1)
    except RuntimeError:
        raise UnsupportedCacheError(f"layer {name!r}: its rows are not contiguous within a block "
                                    f"(strides {list(tensor.stride())}); a page cannot be moved whole") from None
    if viewed.shape[2] != size:
        raise UnsupportedCacheError(f"layer {name!r}: a block holds {viewed.shape[2]} bytes of it; its spec says "
                                    f"{size}")
    return viewed


def planned_content_bytes(vllm_config: Any) -> dict[str, int]:
    """Each DeepSeek-V4 cache's bytes in one block, as ``kvgroups inspect`` plans the model (held to vLLM's own
    specs by a test): for the scheduler's copy of vLLM's KV-cache config, which keeps one spec per group (its
    first layer's), where a group holds pages of several sizes (compressed rows, indexer keys; two states)."""
    config = vllm_config.model_config.hf_config
    packed = str(getattr(vllm_config.cache_config, "cache_dtype", "auto")) in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
    kv_dtype = torch.float8_e4m3fn if packed else torch.bfloat16
    build = build_rank(model_spec_from_config(config.to_dict()), "engine", EngineParams(kv_dtype=kv_dtype))
    return {name: page.content_bytes for name, page in build.pages_of.items()}


def with_layer_pages(plans: dict[str, Any], groups: Any, vllm_config: Any) -> dict[str, Any]:
    """``plans`` with each page-moved layer's own bytes where vLLM's config named one spec for a group of layers of
    several (the scheduler's copy): the bytes ``kvgroups inspect`` plans for it."""
    replaced = [group for group in groups if type(group.kv_cache_spec).__name__ != "UniformTypeKVCacheSpecs"
                and len(group.layer_names) > 1 and any(plans[name].page_bytes for name in group.layer_names
                                                       if name in plans)]
    if not replaced or vllm_config is None:
        return plans
    planned = planned_content_bytes(vllm_config)
    missing = [name for group in replaced for name in group.layer_names if name in plans and name not in planned]
    if missing:
        raise UnsupportedCacheError(f"layers {missing[:4]}: vLLM names one spec for their group and kvgroups "
                                    f"plans no page for them; their pages' sizes are unknown here")
    return {name: replace(plan, page_bytes=planned[name], head_size=planned[name]) if name in planned and
            plan.page_bytes else plan for name, plan in plans.items()}
