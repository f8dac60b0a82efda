"""Engine KV-cache layouts: the axis order of each, defined once, and the geometry read from a shape.

Every other module asks a :class:`KVLayout` for its axes instead of indexing shapes by position.
A layout names the *logical* axis order of the tensor a layer's cache is handed as; strides are
free, so a permuted, non-contiguous view of another storage order is described by the axes of its
shape, which is how engines build HND caches.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgroups.core.cpu_pages import cpu_page_problem, vec_page_plane
from kvgroups.errors import KVGroupsError


class Axis(enum.Enum):
    """One axis of a layer's cache tensor."""

    KV = "kv"  # 0 = keys, 1 = values
    BLOCKS = "num_blocks"
    BLOCK_SIZE = "block_size"
    HEADS = "num_heads"
    HEAD_SIZE = "head_size"
    STATE_SLOTS = "num_state_slots"
    STATE = "state"  # everything after the slot axis of a recurrent state, flattened
    KV_HEAD_SIZE = "2 * head_size"  # one head's keys, then its values, along one axis (vLLM)


_KV, _NB, _BS, _NH, _HS = Axis.KV, Axis.BLOCKS, Axis.BLOCK_SIZE, Axis.HEADS, Axis.HEAD_SIZE
_KVHS = Axis.KV_HEAD_SIZE


class KVLayout(enum.Enum):
    """How one layer's cache is laid out.

    ============== ===================================================== ========================
    member         axes of each tensor                                   tensors per layer
    ============== ===================================================== ========================
    FLASH_ATTN     ``[2, num_blocks, block_size, num_heads, head_size]`` one (vLLM FlashAttention)
    FLASH_ATTN_HND ``[2, num_blocks, num_heads, block_size, head_size]`` one
    FLASHINFER     ``[num_blocks, 2, block_size, num_heads, head_size]`` one (FlashInfer NHD)
    FLASHINFER_HND ``[num_blocks, 2, num_heads, block_size, head_size]`` one (FlashInfer HND)
    MLA            ``[num_blocks, block_size, head_size]``               one latent, kv_size 1
    KV_SPLIT       ``[num_blocks, block_size, num_heads, head_size]``    two: ``(k, v)``
    KV_SPLIT_HND   ``[num_blocks, num_heads, block_size, head_size]``    two: ``(k, v)``
    VLLM           ``[num_blocks, num_heads, block_size, 2 * head_size]`` one (vLLM 0.2x+ GPU backends)
    VLLM_CPU       ``[num_blocks, num_heads, block_size, 2 * head_size]`` one (vLLM's CPU backend)
    VLLM_CPU_AMX   ``[num_blocks, num_heads, block_size, 2 * head_size]`` one (its ``amx`` kernels)
    RECURRENT      ``[num_state_slots, *state_shape]``                   one or more states
    ============== ===================================================== ========================

    The two vLLM layouts are the per-layer ``[B, H, N, C]`` views vLLM hands a KV connector
    (strides free: vLLM's ``LBNHC`` and ``LBHNC`` orders are both such views of one buffer).
    They differ in what sits inside a page: in ``VLLM`` (FlashAttention, FlashInfer, Triton) the
    last axis of each (block, head, token) holds that token's K row, then its V row; in
    ``VLLM_CPU`` (the CPU backend's ``vec`` kernels) each (block, head) page holds the block's K
    transposed, ``[head_size, block_size]``, then its V, ``[block_size, head_size]``, so a
    token's K elements lie ``block_size`` apart; in ``VLLM_CPU_AMX`` (the CPU backend's ``amx``
    kernels, bfloat16 on CPUs with AMX) both halves are packed as AMX tiles
    (:mod:`kvgroups.core.cpu_pages`). The shape cannot tell them apart.
    """

    FLASH_ATTN = "flash_attn"
    FLASH_ATTN_HND = "flash_attn_hnd"
    FLASHINFER = "flashinfer"
    FLASHINFER_HND = "flashinfer_hnd"
    MLA = "mla"
    KV_SPLIT = "kv_split"
    KV_SPLIT_HND = "kv_split_hnd"
    VLLM = "vllm"
    VLLM_CPU = "vllm_cpu"
    VLLM_CPU_AMX = "vllm_cpu_amx"
    RECURRENT = "recurrent"

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Axis order of each tensor of a layer in this layout."""
        return _AXES[self]

    @property
    def tensors_per_layer(self) -> int | None:
        """2 for separate K and V tensors, 1 for one tensor, None for any number (states)."""
        if self in (KVLayout.KV_SPLIT, KVLayout.KV_SPLIT_HND):
            return 2
        if self is KVLayout.RECURRENT:
            return None
        return 1

    @property
    def kv_size(self) -> int:
        """Planes in a stored chunk: 2 (keys, values) or 1 (MLA latent, recurrent state)."""
        if Axis.KV in self.axes or _KVHS in self.axes or self.tensors_per_layer == 2:
            return 2
        return 1

    @property
    def holds_kv(self) -> bool:
        """Whether the layout holds separate keys and values (a paged K/V cache)."""
        return self.kv_size == 2

    @property
    def axes_text(self) -> str:
        """``[2, num_blocks, block_size, num_heads, head_size]``, for error messages and docs."""
        return "[" + ", ".join("2" if axis is _KV else axis.value for axis in self.axes) + "]"

    @property
    def holds_value_head_size(self) -> bool:
        """Whether values may have a head size of their own (unpadded): a ``(k, v)`` pair, or vLLM's
        GPU pages of K rows then V rows (``head_size + head_size_v``). Layouts with a K/V axis hold
        both planes in one head size, so values of another size are padded there; vLLM's CPU
        backend splits each page in two halves of one head size (it has no diff-KV kernels)."""
        return self.holds_kv and Axis.KV not in self.axes and not self.is_cpu_page

    @property
    def is_cpu_page(self) -> bool:
        """Whether each (block, head) page is vLLM's CPU backend's: contiguous, keys then values."""
        return self in (KVLayout.VLLM_CPU, KVLayout.VLLM_CPU_AMX)

    def layout_problem(self, tensor: torch.Tensor, value_head_size: int | None = None) -> str | None:
        """Why ``tensor`` (of this layout's rank) cannot be read in this layout, or None.

        Strides are free except where a layout fixes how a page is laid out: a ``VLLM_CPU`` or
        ``VLLM_CPU_AMX`` page of one (block, head) is ``2 * block_size * head_size`` contiguous
        elements, and an ``amx`` page holds bfloat16 in groups of 16 tokens and 16 head elements.
        """
        # With a value head size of its own the page's split is :func:`geometry`'s to check.
        if _KVHS in self.axes and value_head_size is None and tensor.shape[-1] % 2:
            return f"its last axis (2 * head_size) is {tensor.shape[-1]}, not even"
        if self.is_cpu_page:
            return cpu_page_problem(tensor, amx=self is KVLayout.VLLM_CPU_AMX)
        return None

    @classmethod
    def parse(cls, name: str) -> KVLayout:
        """A layout from its value (``"flashinfer"``); for the CLI and serialized data."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(member.value for member in cls)
            raise KVGroupsError(f"unknown layout {name!r}; expected one of {known}") from None


_AXES: dict[KVLayout, tuple[Axis, ...]] = {
    KVLayout.FLASH_ATTN: (_KV, _NB, _BS, _NH, _HS),
    KVLayout.FLASH_ATTN_HND: (_KV, _NB, _NH, _BS, _HS),
    KVLayout.FLASHINFER: (_NB, _KV, _BS, _NH, _HS),
    KVLayout.FLASHINFER_HND: (_NB, _KV, _NH, _BS, _HS),
    KVLayout.MLA: (_NB, _BS, _HS),
    KVLayout.KV_SPLIT: (_NB, _BS, _NH, _HS),
    KVLayout.KV_SPLIT_HND: (_NB, _NH, _BS, _HS),
    KVLayout.VLLM: (_NB, _NH, _BS, _KVHS),
    KVLayout.VLLM_CPU: (_NB, _NH, _BS, _KVHS),
    KVLayout.VLLM_CPU_AMX: (_NB, _NH, _BS, _KVHS),
    KVLayout.RECURRENT: (Axis.STATE_SLOTS, Axis.STATE),
}

# The order a token's row is stored in a chunk: [num_blocks, block_size, num_heads, head_size].
TOKEN_MAJOR_AXES: tuple[Axis, ...] = (_NB, _BS, _NH, _HS)


@dataclass(frozen=True, kw_only=True)
class CacheGeometry:
    """Sizes of one layer's cache, whatever its layout.

    For a recurrent state, ``num_blocks`` counts state slots (one per sequence), ``block_size``
    and ``num_heads`` are 1 and ``head_size`` is the state's elements per slot, so that
    ``hidden_dim_size`` is what one slot stores.
    """

    kv_size: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    # Values' head size where it differs from the keys' (MiMo-V2's 192 / 128); None: the same.
    value_head_size: int | None = None

    @property
    def hidden_dim_size(self) -> int:
        """Elements one token (one slot, for states) stores per K plane (and per V plane, unless
        values have a head size of their own)."""
        return self.num_heads * self.head_size

    @property
    def value_hidden_dim_size(self) -> int:
        """Elements one token stores per V plane."""
        return self.num_heads * (self.value_head_size or self.head_size)

    @property
    def slot_elements(self) -> int:
        """Elements one token slot (one state slot) stores, all K/V planes together."""
        if self.value_head_size is not None:
            return self.hidden_dim_size + self.value_hidden_dim_size
        return self.kv_size * self.hidden_dim_size

    @property
    def num_slots(self) -> int:
        """Token slots (or state slots) the cache holds: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size


def _check_value_head_size(layout: KVLayout, value_head_size: int | None) -> None:
    if value_head_size is None:
        return
    if isinstance(value_head_size, bool) or not isinstance(value_head_size, int) or value_head_size < 1:
        raise KVGroupsError(f"value_head_size must be a positive int or None, got {value_head_size!r}")
    if not layout.holds_value_head_size:
        holding = ", ".join(member.value for member in KVLayout if member.holds_value_head_size)
        raise KVGroupsError(
            f"layout {layout.value} {layout.axes_text} holds keys and values in one head size; values of "
            f"{value_head_size} need a layout that holds them unpadded ({holding}), or padding to the keys' size"
        )


def geometry(layout: KVLayout, shape: Sequence[int], value_head_size: int | None = None) -> CacheGeometry:
    """Sizes of a cache whose (per-tensor) ``shape`` is in ``layout``.

    For RECURRENT, ``shape`` is ``[num_state_slots, state_elements]`` (states flattened). For
    KV_SPLIT layouts ``shape`` is the keys' tensor. ``value_head_size`` (None: the keys') is the
    values' head size where it differs, for the layouts that hold it (``holds_value_head_size``):
    a vLLM page's last axis is then ``head_size + value_head_size``.
    """
    axes = layout.axes
    if len(shape) != len(axes):
        raise KVGroupsError(
            f"layout {layout.value} expects rank {len(axes)} {layout.axes_text}, got shape {list(shape)}"
        )
    _check_value_head_size(layout, value_head_size)
    size = dict(zip(axes, (int(dim) for dim in shape), strict=True))
    if layout is KVLayout.RECURRENT:
        return CacheGeometry(kv_size=1, num_blocks=size[Axis.STATE_SLOTS], block_size=1, num_heads=1,
                             head_size=size[Axis.STATE])
    if _KVHS in size:
        last = size[_KVHS]
        if value_head_size is not None and value_head_size >= last:
            raise KVGroupsError(f"layout {layout.value} {layout.axes_text}: a last axis of {last} cannot hold values "
                                f"of {value_head_size} after keys; got shape {list(shape)}")
        if value_head_size is None and last % 2:
            raise KVGroupsError(
                f"layout {layout.value} {layout.axes_text} needs an even last axis, got shape {list(shape)}"
            )
        size[_HS] = last // 2 if value_head_size is None else last - value_head_size
    return CacheGeometry(
        kv_size=size.get(_KV, layout.kv_size), num_blocks=size[_NB], block_size=size[_BS],
        num_heads=size.get(_NH, 1), head_size=size[_HS],
        value_head_size=None if value_head_size == size[_HS] else value_head_size,
    )


def shape_for(layout: KVLayout, sizes: CacheGeometry) -> torch.Size:
    """The per-tensor shape of a cache with ``sizes`` in ``layout`` (inverse of :func:`geometry`;
    for KV_SPLIT layouts the keys' tensor)."""
    if layout is KVLayout.RECURRENT:
        return torch.Size([sizes.num_blocks, sizes.head_size])
    _check_value_head_size(layout, sizes.value_head_size)
    by_axis = {
        _KV: sizes.kv_size, _NB: sizes.num_blocks, _BS: sizes.block_size,
        _NH: sizes.num_heads, _HS: sizes.head_size,
        _KVHS: sizes.head_size + (sizes.value_head_size or sizes.head_size),
    }
    return torch.Size([by_axis[axis] for axis in layout.axes])


def detect_layout(value: object) -> KVLayout | None:
    """The layout a cache value unambiguously has, or None.

    A list or tuple of two tensors is KV_SPLIT; a rank-3 tensor is MLA; a rank-5 tensor is
    FLASH_ATTN when its dim 0 is 2 (read as the K/V axis, as LMCache does, even when num_blocks
    is 2 too) and FLASHINFER when only its dim 1 is 2. Heads-before-block-size (HND) orders,
    and vLLM's rank-4 pages (VLLM, VLLM_CPU and VLLM_CPU_AMX differ only inside a page), cannot be told
    apart from a shape and must be passed explicitly.
    """
    if isinstance(value, (list, tuple)):
        return KVLayout.KV_SPLIT if len(value) == 2 else None
    if not isinstance(value, torch.Tensor):
        return None
    return _layout_of_shape(value.shape)


def _layout_of_shape(shape: Sequence[int]) -> KVLayout | None:
    if len(shape) == 3:
        return KVLayout.MLA
    if len(shape) == 5:
        if shape[0] == 2:
            return KVLayout.FLASH_ATTN
        if shape[1] == 2:
            return KVLayout.FLASHINFER
    return None


def layout_from_shape(shape: Sequence[int]) -> KVLayout:
    """The layout one cache tensor of ``shape`` is read in when none is passed, as :func:`detect_layout`."""
    layout = _layout_of_shape(shape)
    if layout is None:
        raise KVGroupsError(
            f"cannot tell the layout of shape {list(shape)}: expected rank 5 with 2 at dim 0 (flash_attn) "
            f"or dim 1 (flashinfer), rank 3 (mla), or a (k, v) pair of tensors; pass layout= for HND "
            f"layouts and for vLLM's rank-4 pages (vllm, vllm_cpu, vllm_cpu_amx)"
        )
    return layout


def to_token_major(layout: KVLayout, tensor: torch.Tensor, kv_index: int,
                   value_head_size: int | None = None) -> torch.Tensor:
    """A view ``[num_blocks, block_size, num_heads, head_size]`` of plane ``kv_index`` of a tensor.

    Writes through the returned view land in ``tensor`` (it is never a copy). For MLA the heads
    axis has size 1; for KV_SPLIT layouts ``tensor`` is the K or the V tensor itself. A
    ``VLLM_CPU`` tensor must pass :meth:`KVLayout.layout_problem` (its pages are contiguous).
    ``VLLM_CPU_AMX`` pages have no such view (a token's elements are not evenly spaced): read them
    through :func:`kvgroups.core.cpu_pages.amx_page_plane`.
    ``value_head_size`` splits a vLLM page's last axis into keys and values of different sizes
    (the V plane's view then has ``value_head_size`` as its last axis).
    """
    if layout is KVLayout.VLLM_CPU:
        return vec_page_plane(tensor, kv_index)
    if layout is KVLayout.VLLM_CPU_AMX:
        raise KVGroupsError("layout vllm_cpu_amx has no token-major view: read it through amx_page_plane")
    axes = layout.axes
    if _KVHS in axes and value_head_size is not None:
        position = axes.index(_KVHS)
        key_size = tensor.shape[position] - value_head_size
        tensor = (tensor.narrow(position, 0, key_size) if kv_index == 0
                  else tensor.narrow(position, key_size, value_head_size))
        axes = (*axes[:position], _HS, *axes[position + 1:])
    elif _KVHS in axes:
        position = axes.index(_KVHS)
        shape = tensor.shape  # splitting one axis is a view whatever the strides
        tensor = tensor.view(*shape[:position], 2, shape[position] // 2, *shape[position + 1:])
        axes = (*axes[:position], _KV, _HS, *axes[position + 1:])
    if _KV in axes:
        tensor = tensor.select(axes.index(_KV), kv_index)
        axes = tuple(axis for axis in axes if axis is not _KV)
    if _NH not in axes:
        tensor = tensor.unsqueeze(axes.index(_HS))
        axes = (*axes[:-1], _NH, _HS)
    return tensor.permute([axes.index(axis) for axis in TOKEN_MAJOR_AXES])

