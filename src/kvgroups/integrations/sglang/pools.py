"""SGLang's host memory pools as kvgroups describes them, and the pages SGLang's keys name in them.

A host pool keeps every layer's K/V (or MLA latent) rows of a token range in one buffer, in one of
SGLang's layouts: ``layer_first`` ``[2, layers, tokens, heads, head_dim]``, ``page_first`` ``[2, tokens,
layers, heads, head_dim]``, ``page_first_direct`` ``[2, pages, layers, page_size, heads, head_dim]`` (MLA
without the leading 2 and with one latent "head"). Each layer's slice of that buffer is a paged cache
kvgroups reads like any engine's (``FLASH_ATTN`` pages, or ``MLA``), so the pool is described by kvgroups'
own layer groups in an ``LMCacheMetadata``: its fingerprint (layers, heads, head sizes, dtype, page size,
rank) names the page format every stored entry must have.

DeepSeek-V4's pools are pages of bytes SGLang's kernels fill (``fp8_ds_mla`` rows, indexer keys, compressor rings),
``[layers, page bytes]`` per 256-token page, moved as bytes and never reinterpreted: the compressed rows and
indexer keys (kvgroups' :class:`~kvgroups.core.row_specs.CompressedRows`), the window's and the compressor
states' page at a page's end (:class:`~kvgroups.core.row_specs.WindowPages`), beside a logical anchor (the ``kv``
pool: no bytes, a marker per page). Their fingerprint is every setting that decides where a byte sits.

A page is moved as SGLang's own pool code moves it (``get_data_page`` / ``set_from_flat_data_page``, the
same bytes SGLang's generic data path hands a backend), so both data paths store and read one entry
format; the pool's layout is part of the page format, since it decides where each byte of a page sits.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.core.cache_specs import LayerCacheSpec, RecurrentState
from kvgroups.core.layouts import KVLayout
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.core.row_specs import CompressedRows, WindowPages
from kvgroups.errors import KVGroupsError

# The name of SGLang's primary KV pool (PoolName.KV); sidecar pools (recurrent states, windows) have others.
KV_POOL = "kv"


class UnsupportedPoolError(KVGroupsError):
    """A host pool kvgroups cannot describe yet; storing its pages would risk another format's bytes."""


@dataclass(frozen=True)
class RankInfo:
    """Which shard of the model a pool holds (SGLang's ``HiCacheStorageConfig``), and the model's name."""

    model_name: str
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @classmethod
    def of(cls, storage_config: Any) -> RankInfo:
        return cls(model_name=storage_config.model_name or "", tp_rank=storage_config.tp_rank,
                   tp_size=storage_config.tp_size, pp_rank=storage_config.pp_rank, pp_size=storage_config.pp_size,
                   cp_rank=getattr(storage_config, "attn_cp_rank", 0),
                   cp_size=getattr(storage_config, "attn_cp_size", 1))


@dataclass(frozen=True)
class PagePool:
    """One registered host pool: what its pages are, and how a page is read out of it or written into it."""

    name: str
    host_pool: Any
    layout: str
    page_tokens: int
    page_dtype: torch.dtype
    page_numel: int
    # Whether every tensor-parallel rank holds its own shard (MHA heads) or all hold the same rows (MLA).
    rank_sharded: bool
    # The page format's fingerprint (its layer groups', or a byte pool's settings), computed once: every page read
    # and written is checked against it.
    fingerprint: str

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.page_dtype.itemsize

    def describe(self) -> dict[str, Any]:
        """Everything that decides how a page's bytes are read, as plain data (for the key namespace)."""
        return {"pool": self.name, "layout": self.layout, "fingerprint": self.fingerprint,
                "page_tokens": self.page_tokens, "page_numel": self.page_numel, "dtype": str(self.page_dtype)}

    def read(self, index: int) -> torch.Tensor:
        """The page starting at host token ``index`` as SGLang's host pool holds it: a view where it can be
        one (flattened, it is the flat page SGLang's generic data path hands over; copied once, by the write)."""
        page: torch.Tensor = self.host_pool.get_data_page(index, flat=False)
        return page

    def write(self, index: int, page: torch.Tensor) -> None:
        self.host_pool.set_from_flat_data_page(index, page)


def _pages(tensor: torch.Tensor, dim: int, page_tokens: int) -> torch.Tensor:
    """``tensor`` with its token axis ``dim`` split into ``[pages, page_tokens]`` (a view: nothing is copied)."""
    shape = list(tensor.shape)
    return tensor.view(*shape[:dim], shape[dim] // page_tokens, page_tokens, *shape[dim + 1:])


def _mha_layers(buffer: torch.Tensor, layout: str, layers: int, page_tokens: int) -> list[torch.Tensor]:
    """Each layer's slice of an MHA host buffer as FLASH_ATTN pages ``[2, pages, page_tokens, heads, dim]``."""
    if layout == "layer_first":
        return [_pages(buffer[:, layer], 1, page_tokens) for layer in range(layers)]
    if layout == "page_first":
        return [_pages(buffer[:, :, layer], 1, page_tokens) for layer in range(layers)]
    if layout == "page_first_direct":
        return [buffer[:, :, layer] for layer in range(layers)]
    raise UnsupportedPoolError(f"SGLang host pool layout {layout!r}: kvgroups describes MHA pools in layer_first, "
                               f"page_first and page_first_direct")


def _mla_layers(buffer: torch.Tensor, layout: str, layers: int, page_tokens: int) -> list[torch.Tensor]:
    """Each layer's slice of an MLA host buffer as MLA pages ``[pages, page_tokens, latent_dim]``."""
    if layout == "layer_first":
        return [_pages(buffer[layer, :, 0], 0, page_tokens) for layer in range(layers)]
    if layout == "page_first":
        return [_pages(buffer[:, layer, 0], 0, page_tokens) for layer in range(layers)]
    if layout == "page_first_direct":
        return [buffer[:, layer, :, 0] for layer in range(layers)]
    raise UnsupportedPoolError(f"SGLang host pool layout {layout!r}: kvgroups describes MLA pools in layer_first, "
                               f"page_first and page_first_direct")


def _describe_mha(name: str, host_pool: Any, rank: RankInfo) -> PagePool:
    if host_pool.head_dim != getattr(host_pool, "v_head_dim", host_pool.head_dim):
        raise UnsupportedPoolError(f"pool {name!r}: keys of {host_pool.head_dim} and values of "
                                   f"{host_pool.v_head_dim} dims are not described yet")
    layers = _mha_layers(host_pool.kv_buffer, host_pool.layout, host_pool.layer_num, host_pool.page_size)
    return _page_pool(name, host_pool, rank, layers, KVLayout.FLASH_ATTN, rank_sharded=True,
                      kv_shape=(host_pool.layer_num, 2, host_pool.page_size, host_pool.head_num, host_pool.head_dim))


def _describe_mla(name: str, host_pool: Any, rank: RankInfo) -> PagePool:
    layers = _mla_layers(host_pool.kv_buffer, host_pool.layout, host_pool.layer_num, host_pool.page_size)
    return _page_pool(name, host_pool, rank, layers, KVLayout.MLA, rank_sharded=False,
                      kv_shape=(host_pool.layer_num, 1, host_pool.page_size, 1, host_pool.kv_cache_dim))


def _describe_mamba(name: str, host_pool: Any, rank: RankInfo) -> PagePool:
    """A recurrent-state pool (mamba, gated DeltaNet): one slot per sequence, each layer's conv states and its
    temporal (SSM) state at one token; SGLang keeps it page-first, ``[slots, layers, 1, *state_shape]``."""
    if host_pool.layout not in ("page_first", "page_first_direct"):
        raise UnsupportedPoolError(f"pool {name!r}: recurrent states in layout {host_pool.layout!r}")
    if host_pool.slot_state_buffers:
        raise UnsupportedPoolError(f"pool {name!r}: recurrent states with slot side states are not described yet")
    buffers = [*host_pool.conv_buffer, *([host_pool.temporal_buffer] if host_pool.temporal_buffer.numel() else [])]
    caches: dict[str, Any] = {}
    specs: dict[str, LayerCacheSpec] = {}
    for layer in range(host_pool.num_mamba_layers):
        # Each state of a layer is a cache of its own: conv and temporal states may differ in dtype.
        for part, buffer in enumerate(buffers):
            state = buffer[:, layer, 0]
            caches[f"layers.{layer}.state{part}"] = state
            specs[f"layers.{layer}.state{part}"] = RecurrentState(state_shapes=(tuple(state.shape[1:]),))
    kv_shape = (host_pool.num_mamba_layers, 2, 1, 1, 1)  # informational: the groups describe the states
    return _page_pool(name, host_pool, rank, caches, KVLayout.RECURRENT, rank_sharded=True, kv_shape=kv_shape,
                      specs=specs)


def _page_pool(name: str, host_pool: Any, rank: RankInfo, layers: list[torch.Tensor] | dict[str, Any],
               layout: KVLayout, *, rank_sharded: bool, kv_shape: tuple[int, int, int, int, int],
               specs: dict[str, LayerCacheSpec] | None = None) -> PagePool:
    # A replicated pool (MLA) is the same on every tensor-parallel rank: one rank's pages serve all of them.
    worker = rank.tp_rank if rank_sharded else 0
    metadata = LMCacheMetadata(rank.model_name, rank.tp_size, rank.tp_size, worker, worker, host_pool.dtype,
                               kv_shape, use_mla=layout is KVLayout.MLA, chunk_size=host_pool.page_size)
    caches = layers if isinstance(layers, dict) else {f"layers.{index}": cache for index, cache in enumerate(layers)}
    metadata.kv_layer_groups_manager.build_kv_layer_groups(
        caches, specs, layout=None if layout is KVLayout.RECURRENT else layout)
    dummy = host_pool.get_data_page(0, flat=True)
    return PagePool(name=name, host_pool=host_pool, layout=host_pool.layout,
                    page_tokens=host_pool.page_size, page_dtype=dummy.dtype, page_numel=dummy.numel(),
                    rank_sharded=rank_sharded, fingerprint=metadata.fingerprint())


# DeepSeek-V4's host pools (SGLang's build_deepseek_v4_hicache_stack), by the name SGLang registers each under:
# what a 256-token page of it holds, in kvgroups' kinds. The window (128 tokens) and the compressor rings (8 rows
# of 4 tokens) are the state at a page's end: one page of 256 tokens.
DEEPSEEK_V4_PAGE_TOKENS = 256
_DEEPSEEK_V4_POOLS: dict[str, tuple[str, LayerCacheSpec]] = {
    "swa": ("DeepSeekV4PagedHostPool", WindowPages(page_tokens=DEEPSEEK_V4_PAGE_TOKENS, pages=1)),
    "draft_swa": ("DeepSeekV4PagedHostPool", WindowPages(page_tokens=DEEPSEEK_V4_PAGE_TOKENS, pages=1)),
    "deepseek_v4_c4": ("DeepSeekV4PagedHostPool", CompressedRows(tokens_per_row=4)),
    "deepseek_v4_c4_indexer": ("DeepSeekV4PagedHostPool", CompressedRows(tokens_per_row=4)),
    "deepseek_v4_c128": ("DeepSeekV4PagedHostPool", CompressedRows(tokens_per_row=128)),
    "deepseek_v4_c4_state": ("DeepSeekV4StateHostPool", WindowPages(page_tokens=DEEPSEEK_V4_PAGE_TOKENS, pages=1)),
    "deepseek_v4_c4_indexer_state": ("DeepSeekV4StateHostPool",
                                     WindowPages(page_tokens=DEEPSEEK_V4_PAGE_TOKENS, pages=1)),
}
# SGLang's settings that change where a byte of a DeepSeek-V4 page sits without changing its size (the V4.1 row
# layouts, the compressed pools' layout, unified fp8 rows, the compressor states' dtype, HIP's indexer pages).
_DEEPSEEK_V4_FORMAT_SETTINGS = ("SGLANG_DSV4_KV_LAYOUT", "SGLANG_DSV4_COMPRESSED_KV_LAYOUT",
                                "SGLANG_DSV4_UNIFIED_KV_FP8", "SGLANG_DSV4_COMPRESS_STATE_DTYPE",
                                "SGLANG_HIP_DSV41_INDEX_K_PAGE8")


def _deepseek_v4_formats() -> dict[str, Any]:
    """SGLang's DeepSeek-V4 format settings as this process resolves them (its defaults where unset)."""
    try:
        from sglang.srt.environ import envs  # noqa: PLC0415 - SGLang's own, present wherever its pools are
    except ImportError:
        return {name: os.environ.get(name) for name in _DEEPSEEK_V4_FORMAT_SETTINGS}
    return {name: getattr(envs, name).get() if hasattr(envs, name) else os.environ.get(name)
            for name in _DEEPSEEK_V4_FORMAT_SETTINGS}


def _describe_logical_anchor(name: str, host_pool: Any, rank: RankInfo) -> PagePool:
    """DeepSeek-V4's ``kv`` pool: SGLang's anchor for the pages of a prefix, holding no bytes. Each of its pages
    is stored as a marker (an entry of no data) after the pages of the pools beside it, as SGLang writes them."""
    if name != KV_POOL:
        raise UnsupportedPoolError(f"SGLang host pool {name!r} of type LogicalHostPool: kvgroups takes a logical pool "
                                   f"only as DeepSeek-V4's anchor, the {KV_POOL!r} pool")
    described = {"sglang_pool": "LogicalHostPool", "page_tokens": host_pool.page_size}
    return PagePool(name=name, host_pool=host_pool, layout="logical", page_tokens=host_pool.page_size,
                    page_dtype=torch.uint8, page_numel=0, rank_sharded=False, fingerprint=_digest(described))


def _describe_deepseek_v4(name: str, host_pool: Any, rank: RankInfo) -> PagePool:
    """One of DeepSeek-V4's byte-page pools: ``[layers, page bytes]`` uint8 per 256-token page, the same on every
    tensor-parallel rank (SGLang's writer rank stores it)."""
    kind = type(host_pool).__name__
    expected = _DEEPSEEK_V4_POOLS.get(name)
    if expected is None or expected[0] != kind:
        known = ", ".join(f"{pool} ({cls})" for pool, (cls, _) in _DEEPSEEK_V4_POOLS.items())
        raise UnsupportedPoolError(f"SGLang host pool {name!r} of type {kind}: kvgroups stores DeepSeek-V4's pools "
                                   f"{known}; not yet V4.1's, the FP4 indexer's, HIP's unified rope pools")
    if host_pool.page_size != DEEPSEEK_V4_PAGE_TOKENS:
        raise UnsupportedPoolError(f"pool {name!r}: pages of {host_pool.page_size} tokens; kvgroups stores "
                                   f"DeepSeek-V4's pages of {DEEPSEEK_V4_PAGE_TOKENS} (SGLang's GPU page size)")
    page = host_pool.get_data_page(0, flat=False)
    if page.dtype != torch.uint8 or page.dim() not in (2, 3) or page.shape[0] != host_pool.layer_num:
        raise UnsupportedPoolError(f"pool {name!r}: a page of shape {tuple(page.shape)} {page.dtype}; expected "
                                   f"[{host_pool.layer_num} layers, bytes] uint8")
    spec = expected[1]
    described = {"sglang_pool": kind, "pool": name, "holds": spec.to_dict(), "layers": host_pool.layer_num,
                 "page_bytes": page[0].numel(), "layout": host_pool.layout, "page_tokens": host_pool.page_size,
                 "formats": _deepseek_v4_formats()}
    if kind == "DeepSeekV4StateHostPool":
        described["ring_rows"] = host_pool.ring_size
        described["state_dtypes"] = sorted({str(pool.kv_score_buffer.kv_score.dtype)
                                            for pool in host_pool.state_pools})
    return PagePool(name=name, host_pool=host_pool, layout=host_pool.layout, page_tokens=host_pool.page_size,
                    page_dtype=torch.uint8, page_numel=page.numel(), rank_sharded=False,
                    fingerprint=_digest(described))


def _digest(described: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def is_deepseek_v4_anchor(pool: PagePool) -> bool:
    return pool.layout == "logical"


def deepseek_v4_pools() -> tuple[str, ...]:
    """The names of DeepSeek-V4's pools kvgroups stores beside the anchor."""
    return tuple(_DEEPSEEK_V4_POOLS)


# SGLang's host pool classes kvgroups describes, by class name (the pools' modules import CUDA-only code
# paths lazily, so their names are what can be compared without importing them). Subclasses are described as
# their base, but DeepSeek-V4's byte pages only as exactly these classes: a subclass (QSA's indexer pool) may
# put other bytes in a page of the same size.
_DESCRIBERS: dict[str, Callable[[str, Any, RankInfo], PagePool]] = {
    "MHATokenToKVPoolHost": _describe_mha,
    "MLATokenToKVPoolHost": _describe_mla,
    "MambaPoolHost": _describe_mamba,
}
_EXACT_DESCRIBERS: dict[str, Callable[[str, Any, RankInfo], PagePool]] = {
    "LogicalHostPool": _describe_logical_anchor,
    "DeepSeekV4PagedHostPool": _describe_deepseek_v4,
    "DeepSeekV4StateHostPool": _describe_deepseek_v4,
}


def describe_pool(name: str, host_pool: Any, rank: RankInfo) -> PagePool:
    """``host_pool`` (registered by SGLang under ``name``) as a :class:`PagePool`; a pool of a kind kvgroups
    does not describe raises :class:`UnsupportedPoolError` naming it, so SGLang refuses to start rather than
    store pages nobody checked."""
    exact = _EXACT_DESCRIBERS.get(type(host_pool).__name__)
    if exact is not None:
        return exact(name, host_pool, rank)
    for cls in type(host_pool).__mro__:
        if cls.__name__ in _EXACT_DESCRIBERS:
            raise UnsupportedPoolError(f"SGLang host pool {name!r} of type {type(host_pool).__name__}: a subclass of "
                                       f"{cls.__name__}, whose pages kvgroups stores only as exactly that class")
        describer = _DESCRIBERS.get(cls.__name__)
        if describer is not None:
            return describer(name, host_pool, rank)
    raise UnsupportedPoolError(f"SGLang host pool {name!r} of type {type(host_pool).__name__}: kvgroups describes "
                               f"{', '.join([*_DESCRIBERS, *_EXACT_DESCRIBERS])} (not yet sliding-window or indexer "
                               f"pools of other models)")
