"""Which attention backends' pages the connector knows, checked at registration against vLLM's forward context.

The layout a layer's pages are planned in (:class:`~kvgroups.integrations.vllm.engine_groups.EnginePlan`)
must be the one its backend writes: each backend here was read from its source, and the CPU
backend's kernel families from what vLLM's cache-writing op wrote. Any other backend is refused
at start-up, naming the layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgroups.core.layouts import KVLayout
from kvgroups.errors import UnsupportedCacheError
from kvgroups.integrations.vllm.engine_groups import EnginePlan

# Attention backends whose pages hold, per (block, head, token), the K row then the V row
# (layout VLLM), read from their sources; MLA backends keep one latent row per token. The diff-KV
# backends (MiMo-V2's keys of 192 and values of 128) write K rows of head_size then V rows of
# head_size_v into the same view, and are the only ones that write values of their own size.
DIFF_KV_BACKENDS = frozenset({"FLASH_ATTN_DIFFKV", "TRITON_ATTN_DIFFKV"})
GPU_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"}) | DIFF_KV_BACKENDS
MLA_BACKENDS = frozenset({"FLASHMLA", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA"})
# The CPU backend's kernel families whose page layouts were checked, by reading back what vLLM's
# cache-writing op wrote (vec16 is what vLLM picks for head sizes that are a multiple of 16 but not
# 32; amx packs bfloat16 pages as AMX tiles); the others (neon, vsx, vxe, rvv) are unchecked.
CPU_ISAS = {KVLayout.VLLM_CPU: frozenset({"vec", "vec16"}), KVLayout.VLLM_CPU_AMX: frozenset({"amx"})}


def check_backends(plan: EnginePlan, forward_context: Mapping[str, Any]) -> None:
    """Raise unless every attention layer's backend (in vLLM's ``static_forward_context``) lays its
    pages out as the plan's layout says."""
    problems = []
    for name, layer_plan in plan.layers.items():
        # A state, or pages moved whole (DeepSeek-V4's, :mod:`.packed_pages`): no backend's row layout is read.
        if not layer_plan.token_indexed or layer_plan.page_bytes:
            continue
        layer = forward_context.get(name)
        backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: None)()
        if layer_plan.layout.is_cpu_page:
            isa, expected = getattr(layer, "isa", None), CPU_ISAS[layer_plan.layout]
            if backend != "CPU_ATTN" or isa not in expected:
                checked = "; ".join(f"{', '.join(sorted(isas))} for {layout.value}"
                                    for layout, isas in CPU_ISAS.items())
                problems.append(f"{name}: backend {backend}, kernels {isa!r} for {layer_plan.dtype} pages planned as "
                                f"{layer_plan.layout.value} (checked: CPU_ATTN with {checked})")
        elif layer_plan.layout is KVLayout.MLA:
            if backend not in MLA_BACKENDS:
                problems.append(f"{name}: MLA backend {backend} (known: {', '.join(sorted(MLA_BACKENDS))})")
        elif layer_plan.value_head_size is not None:
            if backend not in DIFF_KV_BACKENDS:
                problems.append(f"{name}: backend {backend} for values of another head size than keys (known: "
                                f"{', '.join(sorted(DIFF_KV_BACKENDS))})")
        elif backend not in GPU_BACKENDS:
            problems.append(f"{name}: backend {backend} (known: {', '.join(sorted(GPU_BACKENDS))})")
    if problems:
        raise UnsupportedCacheError("KVGroupsConnector does not know the page layout of: " + "; ".join(problems[:4]))
