"""Compressed-attention layers (DeepSeek-V4): what each keeps, in the pages vLLM allocates for them.

A DeepSeek-V4 layer keeps a sliding window of one shared K=V head (``head_dim``, ``sliding_window``
tokens); a layer with a compress ratio ``r`` > 1 also one compressed row per ``r`` tokens and the
compressor's state over its current window; a ratio-4 layer (CSA) adds a lightning indexer with
compressed keys of its own (one per 4 tokens) and its own compressor state. vLLM 0.32-0.34 hold
them as five kinds of page (``models/deepseek_v4/attention.py``, ``compressor.py``,
``v1/attention/backends/mla/sparse_swa.py``), each with its own tokens per block:

- the window (``attn.swa_cache``): rows of the K=V head, blocks of 64 tokens;
- the compressed rows (``attn``): blocks of 256 tokens, so 256 / r rows a block;
- the indexer's keys (``attn.indexer.k_cache``): fp8 with an fp32 scale per 128, 132 bytes a row;
- the compressor states (``attn.compressor.state_cache``, ``attn.indexer.compressor.state_cache``): a
  float32 ``[kv, score]`` row per token over a window of ``r`` tokens (``2 r`` where CSA's windows
  overlap), blocks of 4 (r = 4) or 8 tokens.

Every page is padded (by :mod:`kvgroups.models.engine`) to a multiple of 576 bytes in vLLM's ``fp8_ds_mla``
layout (its default for this model: 448 fp8 values, 64 bf16 RoPE values and 8 scale bytes a row, moved as
bytes), of 512 in the 16-bit layout of its FlashInfer backend. Every cache is the same on all tensor-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgroups.core.cache_specs import RecurrentState, SlidingWindow
from kvgroups.core.row_specs import CompressedRows
from kvgroups.errors import ModelConfigError
from kvgroups.models.layers import INDEXER_QUANT_BLOCK, INDEXER_SCALE_BYTES, CacheRole, RankCache, RowPacking

# vLLM's fixed block sizes for DeepSeek-V4's caches (tokens a block covers).
WINDOW_BLOCK_TOKENS = 64
COMPRESSED_BLOCK_TOKENS = 256
# The compressor state's block: 4 tokens for CSA's ratio 4, 8 for the others.
STATE_BLOCK_TOKENS = {4: 4}
STATE_BLOCK_TOKENS_OTHER = 8
# fp8_ds_mla: one ue8m0 scale per 64 fp8 values, and one byte of padding.
FP8_DS_MLA_SCALE_GROUP = 64
# The ratio whose layers run CSA (overlapping windows, a lightning indexer) in a config that names only ratios.
CSA_RATIO = 4


def fp8_ds_mla_row_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one ``fp8_ds_mla`` row: the values without RoPE in fp8, the RoPE ones in bf16, their scales."""
    nope = head_dim - rope_dim
    return nope + 2 * rope_dim + nope // FP8_DS_MLA_SCALE_GROUP + 1


@dataclass(frozen=True, kw_only=True)
class CompressedAttentionLayer:
    """One DeepSeek-V4 attention layer: ``compress_ratio`` 1 keeps the window only; ``sparse`` (CSA) overlapping
    windows and a lightning indexer (vLLM: the layers of ratio 4; transformers: ``compressed_sparse_attention``)."""

    head_dim: int
    rope_dim: int
    window_tokens: int
    compress_ratio: int
    index_head_dim: int
    sparse: bool

    def __post_init__(self) -> None:
        if self.sparse and self.compress_ratio <= 1:
            raise ModelConfigError("a compressed sparse attention (CSA) layer needs a compress ratio above 1")
        if self.compress_ratio > 1 and COMPRESSED_BLOCK_TOKENS % self.compress_ratio:
            raise ModelConfigError(
                f"compress ratio {self.compress_ratio} does not divide vLLM's block of {COMPRESSED_BLOCK_TOKENS} "
                f"tokens; expected a power of two up to {COMPRESSED_BLOCK_TOKENS}"
            )

    @property
    def summary(self) -> str:
        compressed = "" if self.compress_ratio <= 1 else f" + 1/{self.compress_ratio} rows"
        indexer = " + indexer" if self.sparse else ""
        return f"window {self.window_tokens} 1x{self.head_dim}{compressed}{indexer}"

    def _compressor_state(self, name: str, head_dim: int) -> RankCache:
        overlap = 1 + self.sparse  # CSA's windows overlap: two series per token
        width = 2 * overlap * head_dim  # kv and score, per series
        block = STATE_BLOCK_TOKENS.get(self.compress_ratio, STATE_BLOCK_TOKENS_OTHER)
        return RankCache(spec=SlidingWindow(window_tokens=overlap * self.compress_ratio), num_kv_heads=1,
                         head_size=width, replicated=True, fixed_dtype="float32", mixer=name, part="state",
                         packing=RowPacking(block_tokens=block))

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        packed_rows = fp8_ds_mla_row_bytes(self.head_dim, self.rope_dim)
        caches = []
        if self.sparse:
            key_bytes = self.index_head_dim + self.index_head_dim // INDEXER_QUANT_BLOCK * INDEXER_SCALE_BYTES
            caches += [
                RankCache(spec=CompressedRows(tokens_per_row=self.compress_ratio), num_kv_heads=1, head_size=key_bytes,
                          replicated=True, fixed_dtype="uint8", mixer="attn.indexer.k_cache", part="keys",
                          packing=RowPacking(block_tokens=COMPRESSED_BLOCK_TOKENS)),
                self._compressor_state("attn.indexer.compressor.state_cache", self.index_head_dim),
            ]
        caches.append(RankCache(spec=SlidingWindow(window_tokens=self.window_tokens), num_kv_heads=1,
                                head_size=self.head_dim, replicated=True, role=CacheRole.KV,
                                mixer="attn.swa_cache", part="k=v",
                                packing=RowPacking(block_tokens=WINDOW_BLOCK_TOKENS, packed_row_bytes=packed_rows)))
        if self.compress_ratio > 1:
            caches += [
                RankCache(spec=CompressedRows(tokens_per_row=self.compress_ratio), num_kv_heads=1,
                          head_size=self.head_dim, replicated=True, role=CacheRole.KV, mixer="attn",
                          part="compressed", packing=RowPacking(block_tokens=COMPRESSED_BLOCK_TOKENS,
                                                                packed_row_bytes=packed_rows)),
                self._compressor_state("attn.compressor.state_cache", self.head_dim),
            ]
        return tuple(caches)


# DeepSeek-V4.1 in vLLM: its window's blocks of 32 tokens, its compressed rows' and indexer keys' of vLLM's block
# size on a GPU (128; 64 on Hopper), its compressor's ring of 8 rows (no speculative tokens).
V41_WINDOW_BLOCK_TOKENS = 32
V41_BLOCK_TOKENS = 128
V41_RING_ROWS = 8


@dataclass(frozen=True, kw_only=True)
class CompressedSourceLayer:
    """One DeepSeek-V4.1 layer: a window of one K=V head; a layer that owns compressed KV (``kv_source``) also its
    rows, one per ``compress_ratio`` tokens (1: every token), and an index source among them its indexer's keys
    at the same rate; a ratio-2 source a ring of its compressor's last rows, one block per request. Other layers
    read a source's caches and keep only their window."""

    head_dim: int
    rope_dim: int
    window_tokens: int
    compress_ratio: int
    kv_source: bool
    index_source: bool
    index_head_dim: int

    @property
    def summary(self) -> str:
        owned = f" + 1/{self.compress_ratio} rows" if self.kv_source and self.compress_ratio else ""
        return f"window {self.window_tokens} 1x{self.head_dim}{owned}" + (" + indexer" if self.index_source else "")

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        packed_rows = fp8_ds_mla_row_bytes(self.head_dim, self.rope_dim)
        owns = self.kv_source and self.compress_ratio > 0
        caches = []
        if owns:
            caches.append(RankCache(spec=CompressedRows(tokens_per_row=self.compress_ratio), num_kv_heads=1,
                                    head_size=self.head_dim, replicated=True, mixer="attn", part="compressed",
                                    packing=RowPacking(block_tokens=V41_BLOCK_TOKENS, packed_row_bytes=packed_rows)))
        if owns and self.index_source:
            key_bytes = self.index_head_dim + self.index_head_dim // INDEXER_QUANT_BLOCK * INDEXER_SCALE_BYTES
            caches.append(RankCache(spec=CompressedRows(tokens_per_row=self.compress_ratio), num_kv_heads=1,
                                    head_size=key_bytes, replicated=True, fixed_dtype="uint8",
                                    mixer="attn.indexer.k_cache", part="keys",
                                    packing=RowPacking(block_tokens=V41_BLOCK_TOKENS)))
        caches.append(RankCache(spec=SlidingWindow(window_tokens=self.window_tokens), num_kv_heads=1,
                                head_size=self.head_dim, replicated=True, role=CacheRole.KV, mixer="attn.swa_cache",
                                part="k=v", packing=RowPacking(block_tokens=V41_WINDOW_BLOCK_TOKENS,
                                                               packed_row_bytes=packed_rows)))
        if owns and self.compress_ratio > 1:  # a ring buffer: what the next rows are compressed from, per request
            ring = RecurrentState(state_shapes=((V41_RING_ROWS, 2 * self.head_dim),))
            caches.append(RankCache(spec=ring, num_kv_heads=1, head_size=ring.state_elements, replicated=True,
                                    fixed_dtype="float32", mixer="attn.compressor.state_cache", part="ring"))
        return tuple(caches)
