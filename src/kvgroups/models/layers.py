"""What each layer of a model caches, independent of any engine: one frozen type per layer family.

Each type answers for itself how its cache splits over tensor-parallel ranks
(:meth:`rank_cache`), so nothing downstream switches on the layer family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvgroups.errors import ModelConfigError
from kvgroups.kinds import FullAttention, LayerCacheSpec, MLAttention, RecurrentState


@dataclass(frozen=True, kw_only=True)
class RankCache:
    """One layer's cache on one tensor-parallel rank.

    ``num_kv_heads``/``head_size`` describe token-indexed caches (MLA: 1 head of the latent
    size); ``spec`` carries the per-rank state shapes for recurrent layers.
    """

    spec: LayerCacheSpec
    num_kv_heads: int
    head_size: int
    replicated: bool  # every rank holds the same bytes (MLA latents, heads fewer than ranks)


class ModelLayer(Protocol):
    """A layer of a model, as far as its cache goes."""

    @property
    def summary(self) -> str:
        """Short description for tables: ``full 8x128``, ``mamba2``."""
        ...

    def rank_cache(self, tp: int, layer_index: int) -> RankCache | None:
        """This layer's cache on one of ``tp`` ranks, or None when it keeps no cache."""
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
    """Heads per rank for heads that cannot be replicated (recurrent mixers)."""
    if count % tp:
        raise ModelConfigError(
            f"layer {layer_index}: {what}={count} does not split over --tp {tp}; "
            f"recurrent heads cannot be replicated"
        )
    return count // tp


def conv_and_state(conv_channels: int, conv_kernel: int, state_shape: tuple[int, ...]) -> RankCache:
    """A recurrent layer's cache: a conv state ``(channels, kernel - 1)`` and one state tensor."""
    spec = RecurrentState(state_shapes=((conv_channels, conv_kernel - 1), state_shape))
    return RankCache(spec=spec, num_kv_heads=1, head_size=spec.state_elements, replicated=False)


@dataclass(frozen=True, kw_only=True)
class AttentionLayer:
    """Keys and values of ``num_kv_heads`` heads of ``head_size``; ``spec`` says which tokens."""

    spec: LayerCacheSpec = field(default_factory=FullAttention)
    num_kv_heads: int
    head_size: int

    @property
    def summary(self) -> str:
        return f"{self.spec.kind.value} {self.num_kv_heads}x{self.head_size}"

    def rank_cache(self, tp: int, layer_index: int) -> RankCache:
        heads, replicated = split_heads(self.num_kv_heads, tp, "num_kv_heads", layer_index)
        return RankCache(spec=self.spec, num_kv_heads=heads, head_size=self.head_size, replicated=replicated)


@dataclass(frozen=True, kw_only=True)
class MLALayer:
    """One latent of ``kv_lora_rank + qk_rope_head_dim`` per token, the same on every rank."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def summary(self) -> str:
        return f"mla {self.kv_lora_rank}+{self.qk_rope_head_dim}"

    def rank_cache(self, tp: int, layer_index: int) -> RankCache:
        return RankCache(spec=MLAttention(), num_kv_heads=1, head_size=self.latent_size, replicated=True)


@dataclass(frozen=True, kw_only=True)
class Mamba2Layer:
    """Mamba2 mixer: a conv state and an SSM state per sequence.

    conv: ``(num_heads * head_dim + 2 * n_groups * state_size, conv_kernel - 1)``;
    SSM: ``(num_heads, head_dim, state_size)``. Heads split over ranks; groups split too, or
    are replicated when there are fewer groups than ranks.
    """

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int

    @property
    def summary(self) -> str:
        return "mamba2"

    def rank_cache(self, tp: int, layer_index: int) -> RankCache:
        heads = split_exactly(self.num_heads, tp, "mamba_num_heads", layer_index)
        groups, _ = split_heads(self.n_groups, tp, "n_groups", layer_index)
        conv_channels = heads * self.head_dim + 2 * groups * self.state_size
        return conv_and_state(conv_channels, self.conv_kernel, (heads, self.head_dim, self.state_size))


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetLayer:
    """Gated DeltaNet linear attention (Qwen3-Next): a conv state and a recurrent state.

    conv: ``(2 * key_heads * key_dim + value_heads * value_dim, conv_kernel - 1)``;
    recurrent: ``(value_heads, key_dim, value_dim)``; key and value heads split over ranks.
    """

    num_key_heads: int
    key_head_dim: int
    num_value_heads: int
    value_head_dim: int
    conv_kernel: int

    @property
    def summary(self) -> str:
        return "gated_deltanet"

    def rank_cache(self, tp: int, layer_index: int) -> RankCache:
        key_heads = split_exactly(self.num_key_heads, tp, "linear_num_key_heads", layer_index)
        value_heads = split_exactly(self.num_value_heads, tp, "linear_num_value_heads", layer_index)
        conv_channels = 2 * key_heads * self.key_head_dim + value_heads * self.value_head_dim
        return conv_and_state(conv_channels, self.conv_kernel, (value_heads, self.key_head_dim, self.value_head_dim))


@dataclass(frozen=True, kw_only=True)
class NoCacheLayer:
    """A block that keeps nothing between tokens (MLP, MoE, a no-op or linear attention stand-in)."""

    reason: str

    @property
    def summary(self) -> str:
        return f"none ({self.reason})"

    def rank_cache(self, tp: int, layer_index: int) -> None:
        return None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model's layers and the config facts the cache depends on."""

    model_type: str
    layers: tuple[ModelLayer, ...]
    torch_dtype: str
    max_position_embeddings: int | None
    warnings: tuple[str, ...] = ()
