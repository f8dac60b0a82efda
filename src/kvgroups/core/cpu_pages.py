"""Inside the pages of vLLM's CPU attention backend: where a token's K and V elements sit.

vLLM's CPU backend hands a connector each attention layer as ``[num_blocks, num_heads,
block_size, 2 * head_size]``, and each (block, head) page of ``2 * block_size * head_size``
contiguous elements holds the block's keys in its first half and its values in the second. How a
half is ordered depends on the kernels vLLM picked for the layer (``layer.isa``), read from
vLLM's ``csrc/cpu/cpu_attn_*.hpp`` and checked against its cache-writing op:

- ``vec`` / ``vec16`` (layout ``VLLM_CPU``): keys transposed, ``[head_size, block_size]``; values
  ``[block_size, head_size]``.
- ``amx`` (layout ``VLLM_CPU_AMX``, bfloat16 on CPUs with AMX): both halves packed as AMX B tiles,
  whose rows are 64 bytes of 32-bit pairs. Keys come in groups of 16 tokens; within a group, pair
  ``j`` (elements ``2j``, ``2j + 1``) of every token, token by token, then pair ``j + 1``: element
  ``d`` of token ``t`` at ``(t // 16) * 16 * head_size + (d // 2) * 32 + (t % 16) * 2 + d % 2``.
  Values come in groups of 16 head elements; within a group, tokens go in pairs, and element
  ``d`` of token ``t`` sits at ``(d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2``.

Neither order gives a token its own row, so these views split a page's axes where the order does:
the ``vec`` planes stay four axes ``[num_blocks, block_size, num_heads, head_size]``; an ``amx``
plane is six, ``[num_blocks, block_size // g, g, num_heads, head_size // p, p]``, with ``g`` tokens
per group and ``p`` elements per piece (16 and 2 for keys, 2 and 16 for values). Every view aliases
the cache's storage, so writes land in its pages.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# AMX tiles: rows of 64 bytes, 16 rows; a bfloat16 B tile row is 16 pairs of elements.
AMX_KEY_TOKENS_PER_GROUP = 16
AMX_VALUE_ELEMENTS_PER_GROUP = 16
AMX_ELEMENT_BYTES = 2


class GroupedPlane(NamedTuple):
    """A K or V plane whose token axis is split in groups: ``view[block, offset // tokens_per_group,
    offset % tokens_per_group]`` is a token's ``[num_heads, head_size // p, p]`` elements, in the
    order a chunk row stores them."""

    view: torch.Tensor
    tokens_per_group: int


def vec_page_plane(tensor: torch.Tensor, kv_index: int) -> torch.Tensor:
    """Plane ``kv_index`` of a ``VLLM_CPU`` tensor as a token-major view of its storage.

    Element ``d`` of token ``t``'s K in page (block, head) sits at ``d * block_size + t`` of the
    page, its V element at ``block_size * head_size + t * head_size + d``.
    """
    num_blocks, num_heads, block_size, width = tensor.shape
    head_size = width // 2
    block_stride, head_stride = tensor.stride(0), tensor.stride(1)
    base = tensor.storage_offset()
    if kv_index == 0:
        return tensor.as_strided((num_blocks, block_size, num_heads, head_size),
                                 (block_stride, 1, head_stride, block_size), base)
    return tensor.as_strided((num_blocks, block_size, num_heads, head_size),
                             (block_stride, head_size, head_stride, 1), base + block_size * head_size)


def amx_page_plane(tensor: torch.Tensor, kv_index: int) -> GroupedPlane:
    """Plane ``kv_index`` of a ``VLLM_CPU_AMX`` tensor (pages as vLLM's ``amx`` kernels write them)."""
    num_blocks, num_heads, block_size, width = tensor.shape
    head_size = width // 2
    block_stride, head_stride = tensor.stride(0), tensor.stride(1)
    base = tensor.storage_offset()
    if kv_index == 0:
        group = AMX_KEY_TOKENS_PER_GROUP
        view = tensor.as_strided(
            (num_blocks, block_size // group, group, num_heads, head_size // 2, 2),
            (block_stride, group * head_size, 2, head_stride, 2 * group, 1), base)
        return GroupedPlane(view, group)
    piece = AMX_VALUE_ELEMENTS_PER_GROUP
    view = tensor.as_strided(
        (num_blocks, block_size // 2, 2, num_heads, head_size // piece, piece),
        (block_stride, 2 * piece, 1, head_stride, piece * block_size, 2), base + block_size * head_size)
    return GroupedPlane(view, 2)


def cpu_page_problem(tensor: torch.Tensor, amx: bool) -> str | None:
    """Why ``tensor`` cannot hold vLLM CPU pages (``amx``: as its ``amx`` kernels pack them), or None."""
    block_size, width = tensor.shape[2], tensor.shape[3]
    if (width > 1 and tensor.stride(3) != 1) or (block_size > 1 and tensor.stride(2) != width):
        return (f"its strides {list(tensor.stride())} do not keep each (block, head) page of "
                f"{block_size} x {width} elements contiguous, as vLLM's CPU backend does")
    if not amx:
        return None
    head_size = width // 2
    if tensor.element_size() != AMX_ELEMENT_BYTES:
        return f"vLLM's amx pages hold elements of {AMX_ELEMENT_BYTES} bytes (bfloat16), not {tensor.dtype}"
    if block_size % AMX_KEY_TOKENS_PER_GROUP or head_size % AMX_VALUE_ELEMENTS_PER_GROUP:
        return (f"vLLM's amx pages need a block size and a head size that are multiples of 16; got block "
                f"size {block_size}, head size {head_size}")
    return None
