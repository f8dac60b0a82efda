"""Which dtype each cache of a model is kept in, from the engine's options and the config.

As in vLLM: keys and values in the KV dtype; conv states in the conv-state dtype, else the state
dtype; SSM states in the SSM-state dtype, else the dtype the config names for them
(``mamba_ssm_cache_dtype``, ``mamba_ssm_dtype``), else the state dtype; a lightning-attention
state in the state dtype; every option that is not given falls back to the config's
``torch_dtype``. A sparse indexer's keys keep their own dtype (uint8) whatever the options. A model whose
engine packs its rows (DeepSeek-V4 in vLLM: ``fp8_ds_mla``) defaults to that layout's 8-bit KV dtype.

A state dtype is resolved strictly only for a model that keeps a recurrent state: an
attention-only model whose ``torch_dtype`` cannot hold one (``int8``) has no state dtype (None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgroups.core.dtypes import KV_CACHE_DTYPES, STATE_DTYPES, dtype_among, dtype_from_name
from kvgroups.errors import ModelConfigError
from kvgroups.models.layers import CacheRole, ModelSpec, RankCache


@dataclass(frozen=True, kw_only=True)
class CacheDtypes:
    """The dtype of each role; the state roles are None for a model without a recurrent state
    whose ``torch_dtype`` cannot hold one."""

    kv: torch.dtype
    state: torch.dtype | None
    conv_state: torch.dtype | None
    ssm_state: torch.dtype | None

    def of(self, cache: RankCache) -> torch.dtype:
        if cache.fixed_dtype is not None:
            return dtype_from_name(cache.fixed_dtype)
        dtype = {
            CacheRole.KV: self.kv, CacheRole.STATE: self.state, CacheRole.CONV_STATE: self.conv_state,
            CacheRole.SSM_STATE: self.ssm_state,
        }[cache.role]
        if dtype is None:  # resolve_dtypes resolves every state dtype of a model that has states
            raise ModelConfigError(f"no dtype was resolved for a {cache.holds} cache")
        return dtype


def _has_state(spec: ModelSpec) -> bool:
    return any(not cache.spec.token_indexed for index, layer in enumerate(spec.layers)
               for cache in layer.rank_caches(1, index))


def _from_config(spec: ModelSpec, allowed: tuple[str, ...], what: str, option: str,
                 required: bool = True) -> torch.dtype | None:
    dtype = dtype_among(spec.torch_dtype, allowed)
    if dtype is None:
        if not required:
            return None
        raise ModelConfigError(
            f"config torch_dtype {spec.torch_dtype!r} cannot hold {what}; expected one of {', '.join(allowed)} "
            f"(or choose with {option})"
        )
    return dtype


# The KV dtype of a model whose engine packs its rows (vLLM's fp8_ds_mla for DeepSeek-V4: its KV dtype
# "auto" is that layout, on FlashMLA, ROCm and the CPU alike).
PACKED_ROWS_KV_DTYPE = torch.float8_e4m3fn


def _packs_rows(spec: ModelSpec) -> bool:
    return any(cache.packing is not None and cache.packing.packed_row_bytes is not None
               for index, layer in enumerate(spec.layers) for cache in layer.rank_caches(1, index))


def resolve_dtypes(
    spec: ModelSpec, *, kv: torch.dtype | None, state: torch.dtype | None, conv_state: torch.dtype | None,
    ssm_state: torch.dtype | None,
) -> CacheDtypes:
    """Every role's dtype; None options fall back as the module says."""
    kv_dtype = kv or (PACKED_ROWS_KV_DTYPE if _packs_rows(spec) else
                      _from_config(spec, KV_CACHE_DTYPES, "a KV cache", "--kv-dtype"))
    state_dtype = state or _from_config(spec, STATE_DTYPES, "a recurrent state", "--state-dtype",
                                        required=_has_state(spec))
    if kv_dtype is None:  # required: _from_config raised
        raise ModelConfigError("no KV dtype")
    config_ssm = dtype_from_name(spec.ssm_state_dtype) if spec.ssm_state_dtype else None
    return CacheDtypes(kv=kv_dtype, state=state_dtype, conv_state=conv_state or state_dtype,
                       ssm_state=ssm_state or config_ssm or state_dtype)
