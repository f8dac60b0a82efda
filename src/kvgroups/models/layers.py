"""What each layer of a model caches, independent of any engine: one frozen type per layer family.

Each type answers for itself what it keeps on one of ``tp`` tensor-parallel ranks
(:meth:`ModelLayer.rank_caches`), so nothing downstream switches on the layer family. A layer may
keep several caches (an attention K/V cache beside a mamba state, an MLA latent beside a sparse
indexer's keys, a conv state and an SSM state that live in different dtypes). The recurrent
layers live in :mod:`kvgroups.models.state_layers`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from kvgroups.core.cache_specs import FullAttention, LayerCacheSpec, MLAttention, RecurrentState, SlidingWindow
from kvgroups.errors import ModelConfigError


class CacheRole(enum.Enum):
    """Which dtype a cache is kept in (resolved by the engine from its options and the config)."""

    KV = "kv"  # keys and values, MLA latents: --kv-dtype
    CONV_STATE = "conv_state"  # --conv-state-dtype, else --state-dtype
    SSM_STATE = "ssm_state"  # --ssm-state-dtype, else the config's SSM-state dtype, else --state-dtype
    STATE = "state"  # --state-dtype only (vLLM keeps a lightning-attention state in its mamba cache dtype)


@dataclass(frozen=True, kw_only=True)
class RowPacking:
    """How an engine that fixes its own pages for a cache holds it (vLLM for DeepSeek-V4).

    ``block_tokens`` tokens a block (whatever ``--block-size`` says); pages padded to the engine's
    alignment for the model's layout; ``packed_row_bytes``: with an 8-bit KV dtype the rows are packed
    records of this many bytes (``fp8_ds_mla``), held as uint8 and moved as bytes.
    """

    block_tokens: int
    packed_row_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class RankCache:
    """One cache of one layer on one tensor-parallel rank.

    ``num_kv_heads``/``head_size`` describe token-indexed caches (MLA: 1 head of the latent
    size), ``value_head_size`` the values' head size where it differs from the keys' (None: the
    same); ``spec`` carries the per-rank state shapes for recurrent states. ``mixer`` and
    ``part`` say what it is (``mamba2`` / ``conv``). A cache with ``tokens_per_image`` holds
    the keys and values of image tokens (cross-attention), a fixed cost per image, not per
    text token; it is not grouped with the text-token caches.
    """

    spec: LayerCacheSpec
    num_kv_heads: int
    head_size: int
    replicated: bool  # every rank holds the same bytes (MLA latents, heads fewer than ranks)
    value_head_size: int | None = None
    role: CacheRole = CacheRole.KV
    fixed_dtype: str | None = None  # the cache's own dtype whatever the options (a sparse indexer's uint8 keys)
    mixer: str = "attention"
    part: str = "k/v"
    tokens_per_image: int | None = None
    packing: RowPacking | None = None  # pages the engine fixes itself (None: --block-size, unpadded)
    # One row per token for keys and values alike (an MLA latent, windowed or not): held in MLA's layout whatever
    # layout the attention caches take.
    single_row: bool = False

    @property
    def holds(self) -> str:
        return f"{self.mixer} {self.part}"


class ModelLayer(Protocol):
    """A layer of a model, as far as its caches go."""

    @property
    def summary(self) -> str:
        """Short description for tables: ``full_attention 8x128``, ``mamba2``."""
        ...

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        """This layer's caches on one of ``tp`` ranks; empty when it keeps none."""
        ...


def split_heads(num_heads: int, tp: int, what: str, layer_index: int) -> tuple[int, bool]:
    """Heads per rank and whether they are replicated; heads fewer than ranks: one each."""
    if num_heads % tp == 0:
        return num_heads // tp, False
    if tp % num_heads == 0:
        return 1, True
    raise ModelConfigError(
        f"layer {layer_index}: {what}={num_heads} splits neither way over --tp {tp}; "
        f"use a tp that divides {num_heads} or that {num_heads} divides"
    )


def split_exactly(count: int, tp: int, what: str, layer_index: int) -> int:
    """Heads (or channels) per rank for what cannot be replicated (recurrent mixers)."""
    if count % tp:
        raise ModelConfigError(
            f"layer {layer_index}: {what}={count} does not split over --tp {tp}; "
            f"recurrent heads cannot be replicated"
        )
    return count // tp


def state_part(shape: tuple[int, ...], role: CacheRole, mixer: str, part: str) -> RankCache:
    """One state tensor of a recurrent layer (the engine merges a layer's parts that share a dtype)."""
    spec = RecurrentState(state_shapes=(shape,))
    return RankCache(spec=spec, num_kv_heads=1, head_size=spec.state_elements, replicated=False, role=role,
                     mixer=mixer, part=part)


@dataclass(frozen=True, kw_only=True)
class AttentionLayer:
    """Keys and values of ``num_kv_heads`` heads; ``spec`` says which tokens.

    ``value_head_size`` (None: ``head_size``) may differ from the keys' head size (MiMo-V2:
    192 / 128). The engine decides what that costs: vLLM's pages hold keys then values unpadded;
    a layout whose K and V planes share one head size holds values padded to the larger of the two.
    """

    spec: LayerCacheSpec = field(default_factory=FullAttention)
    num_kv_heads: int
    head_size: int
    value_head_size: int | None = None

    @property
    def summary(self) -> str:
        value = f"/{self.value_head_size}" if self.value_head_size not in (None, self.head_size) else ""
        return f"{self.spec.kind.value} {self.num_kv_heads}x{self.head_size}{value}"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        heads, replicated = split_heads(self.num_kv_heads, tp, "num_kv_heads", layer_index)
        values = None if self.value_head_size == self.head_size else self.value_head_size
        return (RankCache(spec=self.spec, num_kv_heads=heads, head_size=self.head_size, replicated=replicated,
                          value_head_size=values),)


@dataclass(frozen=True, kw_only=True)
class CrossAttentionLayer:
    """Keys and values of the image tokens a text layer attends to (mllama's cross-attention layers).

    They are computed once per image and do not grow with the text, so they cost
    ``tokens_per_image`` entries per image, not one per text token.
    """

    num_kv_heads: int
    head_size: int
    tokens_per_image: int

    @property
    def summary(self) -> str:
        return f"cross_attention {self.num_kv_heads}x{self.head_size}"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        heads, replicated = split_heads(self.num_kv_heads, tp, "num_kv_heads", layer_index)
        return (RankCache(spec=FullAttention(), num_kv_heads=heads, head_size=self.head_size, replicated=replicated,
                          mixer="cross_attention", tokens_per_image=self.tokens_per_image),)


@dataclass(frozen=True, kw_only=True)
class MLALayer:
    """One latent of ``kv_lora_rank + qk_rope_head_dim`` per token, the same on every rank; of the last
    ``window_tokens`` tokens only where the layer slides (dots3's sliding layers)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    window_tokens: int | None = None

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def summary(self) -> str:
        window = f" window {self.window_tokens}" if self.window_tokens else ""
        return f"mla {self.kv_lora_rank}+{self.qk_rope_head_dim}{window}"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        spec: LayerCacheSpec = SlidingWindow(window_tokens=self.window_tokens) if self.window_tokens else MLAttention()
        return (RankCache(spec=spec, num_kv_heads=1, head_size=self.latent_size, replicated=True, mixer="mla",
                          part="latent", single_row=True),)


# A sparse-attention indexer's key cache (DeepSeek-V3.2, GLM-5): fp8 values with one fp32 scale per
# block of this many, stored as bytes (vLLM's DeepseekV32IndexerCache).
INDEXER_QUANT_BLOCK = 128
INDEXER_SCALE_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class IndexedMLALayer:
    """MLA plus a sparse-attention indexer (DSA) that keeps one key of ``index_head_dim`` per token.

    The indexer's keys are stored as fp8 with an fp32 scale per 128 values, ``index_head_dim +
    index_head_dim // 128 * 4`` bytes per token, whatever the KV dtype, and the same on every
    rank. A layer that reuses the previous layer's top-k (``has_indexer`` False) keeps no keys.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    has_indexer: bool = True

    @property
    def latent(self) -> MLALayer:
        """The layer's MLA latent cache, as in a layer without an indexer."""
        return MLALayer(kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    @property
    def indexer_bytes(self) -> int:
        return self.index_head_dim + self.index_head_dim // INDEXER_QUANT_BLOCK * INDEXER_SCALE_BYTES

    @property
    def summary(self) -> str:
        return self.latent.summary + (f" + indexer {self.index_head_dim}" if self.has_indexer else "")

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        caches = self.latent.rank_caches(tp, layer_index)
        if not self.has_indexer:
            return caches
        keys = RankCache(spec=MLAttention(), num_kv_heads=1, head_size=self.indexer_bytes, replicated=True,
                         fixed_dtype="uint8", mixer="indexer", part="keys")
        return (*caches, keys)


@dataclass(frozen=True, kw_only=True)
class ParallelLayer:
    """Mixers side by side in one layer, each with its own cache (Falcon-H1: attention and mamba2;
    Zamba2's hybrid layers: a shared attention block, with a K/V cache of its own at each position,
    and a mamba2 mixer)."""

    mixers: tuple[ModelLayer, ...]

    @property
    def summary(self) -> str:
        return " + ".join(mixer.summary for mixer in self.mixers)

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        return tuple(cache for mixer in self.mixers for cache in mixer.rank_caches(tp, layer_index))


@dataclass(frozen=True, kw_only=True)
class NoCacheLayer:
    """A block that keeps nothing between tokens (MLP, MoE, a no-op, a layer sharing another's KV)."""

    reason: str

    @property
    def summary(self) -> str:
        return f"none ({self.reason})"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        return ()


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model's layers and the config facts the cache depends on.

    ``ssm_state_dtype`` is the dtype the config names for SSM states (``mamba_ssm_cache_dtype``,
    ``mamba_ssm_dtype``, or the family's default), None when it names none.
    """

    model_type: str
    layers: tuple[ModelLayer, ...]
    torch_dtype: str
    max_position_embeddings: int | None
    warnings: tuple[str, ...] = ()
    ssm_state_dtype: str | None = None
