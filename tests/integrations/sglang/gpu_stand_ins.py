"""Stand-ins, named as such, for what only a GPU build of SGLang has, so its HiCache controller runs on the CPU.

SGLang moves pages between its device pool and its host pool with the KV-transfer kernels of
``sgl_kernel`` (absent here: they are CUDA code) on streams it synchronises, in host memory it pins with
``cudaHostRegister``. Here the device pool lives in CPU memory too: the transfers below copy the same bytes
with ``ctypes.memmove`` over the same address tables the kernels read, CPU streams get the ``synchronize``
CUDA streams have, and pinning does nothing. None of this is kvgroups' code path: the backend under test
only ever sees host pages, as on a GPU server.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def _rows(src: list[int], dst: list[int], src_indices: torch.Tensor, dst_indices: torch.Tensor,
          src_stride: int, dst_stride: int, size: int) -> None:
    for source, target in zip(src_indices.tolist(), dst_indices.tolist(), strict=True):
        for src_base, dst_base in zip(src, dst, strict=True):
            ctypes.memmove(dst_base + target * dst_stride, src_base + source * src_stride, size)


def transfer_kv_all_layer(src_k_layers: torch.Tensor, dst_k_layers: torch.Tensor, src_v_layers: torch.Tensor,
                          dst_v_layers: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                          item_size: int, num_layers: int) -> None:
    """Every layer's K and V rows ``src_indices`` -> ``dst_indices``, each side a table of per-layer addresses."""
    for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        _rows(src.tolist()[:num_layers], dst.tolist()[:num_layers], src_indices, dst_indices, item_size, item_size,
              item_size)


def transfer_kv_per_layer(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor, dst_v: torch.Tensor,
                          src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int) -> None:
    """One layer's K and V rows ``src_indices`` -> ``dst_indices``."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _rows([src.data_ptr()], [dst.data_ptr()], src_indices, dst_indices, item_size, item_size, item_size)


def transfer_kv_all_layer_lf_pf(src_k_layers: torch.Tensor, dst_k: torch.Tensor, src_v_layers: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                item_size: int, dst_layout_dim: int, num_layers: int) -> None:
    """Every layer's K and V rows from per-layer device buffers into a page-first host buffer, where a token's
    layers lie side by side (``dst_layout_dim`` bytes a token)."""
    for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        _rows(src.tolist()[:num_layers], [dst.data_ptr() + layer * item_size for layer in range(num_layers)],
              src_indices, dst_indices, item_size, dst_layout_dim, item_size)


def transfer_kv_mamba_lf_pf(src_ptrs: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor,
                            dst_indices: torch.Tensor, item_size: int, dst_layout_dim: int, num_layers: int) -> None:
    """Every layer's state slots from per-layer device buffers into a page-first host buffer (a slot's layers
    side by side, ``dst_layout_dim`` bytes a slot)."""
    _rows(src_ptrs.tolist()[:num_layers], [dst.data_ptr() + layer * item_size for layer in range(num_layers)],
          src_indices, dst_indices, item_size, dst_layout_dim, item_size)


def transfer_kv_all_layer_mla(src_layers: torch.Tensor, dst_layers: torch.Tensor, src_indices: torch.Tensor,
                              dst_indices: torch.Tensor, item_size: int, num_layers: int) -> None:
    """Every layer's MLA latent rows ``src_indices`` -> ``dst_indices``, each side a table of per-layer addresses."""
    _rows(src_layers.tolist()[:num_layers], dst_layers.tolist()[:num_layers], src_indices, dst_indices, item_size,
          item_size, item_size)


def install() -> None:
    """Put the stand-ins where SGLang's host pools and transfer code look them up."""
    from sglang.srt.mem_cache.pool_host import common, mamba, mha, mla

    mha.transfer_kv_all_layer = transfer_kv_all_layer
    mha.transfer_kv_per_layer = transfer_kv_per_layer
    mha.transfer_kv_all_layer_lf_pf = transfer_kv_all_layer_lf_pf
    mamba.transfer_kv_mamba_lf_pf = transfer_kv_mamba_lf_pf
    mla.transfer_kv_all_layer_mla = transfer_kv_all_layer_mla
    common._cuda_host_register = lambda *args, **kwargs: None
    common._cuda_host_unregister = lambda *args, **kwargs: None

    def synchronize(self: Any) -> None:
        """A CPU stream's work is done when it is submitted."""

    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = synchronize  # type: ignore[attr-defined]
