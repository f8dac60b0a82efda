"""Recurrent layers: a fixed-size state per sequence, whatever its length.

Shapes and their split over tensor-parallel ranks follow vLLM's ``MambaStateShapeCalculator``
(``mamba_utils.py``); a conv state is written ``(channels, kernel - 1)`` (the byte count is the
same in either axis order). Each state tensor is its own part with its own dtype role: the
conv state follows ``--conv-state-dtype``, the SSM (or delta-rule) state ``--ssm-state-dtype``
or the config's SSM dtype; the engine keeps a layer's parts that end up in one dtype as one
cache, as vLLM's mamba spec holds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvgroups.errors import ModelConfigError
from kvgroups.models.layers import CacheRole, RankCache, split_exactly, state_part


def _groups_per_rank(n_groups: int, tp: int, layer_index: int) -> int:
    """Mamba2 B/C groups per rank: split, or one replicated group on every rank (vLLM's rule)."""
    if n_groups % tp == 0:
        return n_groups // tp
    if n_groups == 1:
        return 1
    raise ModelConfigError(
        f"layer {layer_index}: n_groups={n_groups} does not split over --tp {tp}; a mamba2 layer needs "
        f"groups that split over the ranks, or a single group"
    )


@dataclass(frozen=True, kw_only=True)
class Mamba1Layer:
    """Mamba (v1) mixer (Mamba, Falcon-Mamba, Jamba): conv ``(intermediate, kernel - 1)`` and SSM
    ``(intermediate, state_size)``; the intermediate channels split over ranks."""

    intermediate_size: int
    state_size: int
    conv_kernel: int

    @property
    def summary(self) -> str:
        return "mamba"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        channels = split_exactly(self.intermediate_size, tp, "mamba intermediate_size", layer_index)
        return (
            state_part((channels, self.conv_kernel - 1), CacheRole.CONV_STATE, "mamba", "conv"),
            state_part((channels, self.state_size), CacheRole.SSM_STATE, "mamba", "ssm"),
        )


@dataclass(frozen=True, kw_only=True)
class Mamba2Layer:
    """Mamba2 mixer: a conv state and an SSM state per sequence.

    conv: ``(num_heads * head_dim + 2 * n_groups * state_size, conv_kernel - 1)``;
    SSM: ``(num_heads, head_dim, state_size)``. Heads split over ranks; groups split too, or a
    single group is replicated on every rank.
    """

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int

    @property
    def summary(self) -> str:
        return "mamba2"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        heads = split_exactly(self.num_heads, tp, "mamba_num_heads", layer_index)
        groups = _groups_per_rank(self.n_groups, tp, layer_index)
        conv_channels = heads * self.head_dim + 2 * groups * self.state_size
        return (
            state_part((conv_channels, self.conv_kernel - 1), CacheRole.CONV_STATE, "mamba2", "conv"),
            state_part((heads, self.head_dim, self.state_size), CacheRole.SSM_STATE, "mamba2", "ssm"),
        )


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetLayer:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a conv state and a recurrent state.

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

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        key_heads = split_exactly(self.num_key_heads, tp, "linear_num_key_heads", layer_index)
        value_heads = split_exactly(self.num_value_heads, tp, "linear_num_value_heads", layer_index)
        conv_channels = 2 * key_heads * self.key_head_dim + value_heads * self.value_head_dim
        return (
            state_part((conv_channels, self.conv_kernel - 1), CacheRole.CONV_STATE, "deltanet", "conv"),
            state_part((value_heads, self.key_head_dim, self.value_head_dim), CacheRole.SSM_STATE, "deltanet", "state"),
        )


@dataclass(frozen=True, kw_only=True)
class ShortConvLayer:
    """A gated short convolution (LFM2's ``conv`` layers): only a conv state ``(channels, L - 1)``."""

    channels: int
    conv_kernel: int

    @property
    def summary(self) -> str:
        return "short_conv"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        channels = split_exactly(self.channels, tp, "conv_dim", layer_index)
        return (state_part((channels, self.conv_kernel - 1), CacheRole.CONV_STATE, "short_conv", "conv"),)


@dataclass(frozen=True, kw_only=True)
class ConvStates:
    """Short convolutions a layer runs beside its mixer, each keeping the last ``conv_kernel - 1`` inputs of its
    channels, in float32 whatever the model's dtype (Inkling: over the K and V projections, the attention's output
    and the MLP's: the modules run in float32)."""

    channels: tuple[int, ...]
    conv_kernel: int

    @property
    def summary(self) -> str:
        return f"{len(self.channels)} conv states"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        caches = []
        for number, channels in enumerate(self.channels):
            part = state_part((split_exactly(channels, tp, "conv channels", layer_index), self.conv_kernel - 1),
                              CacheRole.CONV_STATE, "short_conv", f"conv{number}")
            caches.append(dataclasses.replace(part, fixed_dtype="float32"))
        return tuple(caches)


@dataclass(frozen=True, kw_only=True)
class LightningAttentionLayer:
    """Lightning (linear) attention (MiniMax-Text-01 / M1): one ``(heads, head_dim, head_dim)`` state.

    vLLM keeps it in the mamba cache dtype (``--state-dtype``), not the SSM-state dtype.
    """

    num_heads: int
    head_dim: int

    @property
    def summary(self) -> str:
        return "lightning"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        heads = split_exactly(self.num_heads, tp, "num_attention_heads", layer_index)
        return (state_part((heads, self.head_dim, self.head_dim), CacheRole.STATE, "lightning", "state"),)


@dataclass(frozen=True, kw_only=True)
class KimiDeltaLayer:
    """Kimi Delta Attention (Kimi-Linear, Bailing's hybrid): the q, k and v short convolutions as one conv
    state ``(3 * heads * head_dim, kernel - 1)`` and a ``(heads, head_dim, head_dim)`` recurrent state
    kept in float32 whatever the model dtype (vLLM's ``kda_state_dtype``; transformers stores it so too)."""

    num_heads: int
    head_dim: int
    conv_kernel: int

    @property
    def summary(self) -> str:
        return "kimi_delta"

    def rank_caches(self, tp: int, layer_index: int) -> tuple[RankCache, ...]:
        heads = split_exactly(self.num_heads, tp, "linear_num_heads", layer_index)
        conv = state_part((3 * heads * self.head_dim, self.conv_kernel - 1), CacheRole.CONV_STATE, "kda", "conv")
        state = state_part((heads, self.head_dim, self.head_dim), CacheRole.SSM_STATE, "kda", "state")
        return conv, dataclasses.replace(state, fixed_dtype="float32")
