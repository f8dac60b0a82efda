"""Hugging Face ``config.json`` dicts -> :class:`~kvgroups.models.layers.ModelSpec`.

The config (or its ``text_config``) is read by the family its ``model_type`` names; the families
live in :mod:`kvgroups.models.families`, the mechanism in :mod:`kvgroups.models.config_fields`.
A config is read right or refused: an unknown ``model_type`` is refused unless the caller names
a family to read it as (``assume``), and a config carrying fields that change the cache but that
its family does not read is refused rather than guessed at.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvgroups.core.dtypes import STATE_DTYPES, dtype_among, dtype_name
from kvgroups.errors import ModelConfigError
from kvgroups.models import families
from kvgroups.models.config_fields import (
    FAMILIES,
    ConfigFields,
    Family,
    supported_model_types,
    unread_cache_fields,
)
from kvgroups.models.layers import ModelSpec
from kvgroups.models.transformers_types import inspect_refusal

logger = logging.getLogger(__name__)

# Importing the families registers them; named here so that the import is not an accident.
FAMILY_MODULES = families.__all__

__all__ = ["model_spec_from_config", "supported_model_types"]


def _unwrap(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """The text model's config (multimodal configs nest it in ``text_config``) and the dtype."""
    dtype = config.get("torch_dtype") or config.get("dtype")
    text = config.get("text_config")
    if isinstance(text, Mapping) and text:
        return text, text.get("torch_dtype") or text.get("dtype") or dtype
    return config, dtype


def _family(inner: Mapping[str, Any], config: Mapping[str, Any], assume: str | None,
            warnings: list[str]) -> tuple[str, Family, str]:
    """The config's model_type, the family that reads it, and that family's name."""
    inner_type, outer_type = str(inner.get("model_type") or ""), str(config.get("model_type") or "")
    model_type = inner_type or outer_type
    for candidate in (inner_type, outer_type):
        if candidate in FAMILIES:
            if assume is not None and assume != candidate:
                warnings.append(f"--assume {assume} ignored: model_type {candidate!r} is supported")
            return model_type, FAMILIES[candidate], candidate
    named = f"model_type {model_type!r} is not supported" if model_type else "the config has no model_type"
    refusal = inspect_refusal(model_type) if model_type else None
    if refusal is not None:  # found by the sweep over transformers' model types
        named = f"{named} ({refusal})"
    if assume is None:
        raise ModelConfigError(
            f"{named}; supported: {', '.join(supported_model_types())}; --assume MODEL_TYPE reads it as one of "
            f"them (a guess: check the numbers)"
        )
    if assume not in FAMILIES:
        raise ModelConfigError(f"--assume {assume!r} is not a supported model_type; expected one of "
                               f"{', '.join(supported_model_types())}")
    warnings.append(f"{named}; read as {assume} (--assume {assume}), a guess")
    return model_type, FAMILIES[assume], assume


def _ssm_state_dtype(wrapped: ConfigFields) -> str | None:
    for name in wrapped.family.ssm_dtype_fields:
        value = wrapped.get(name)
        if value is None or value == "auto":
            continue
        dtype = dtype_among(str(value), STATE_DTYPES)
        if dtype is None:
            raise ModelConfigError(f"config field {name!r} is {value!r}; expected auto or one of "
                                   f"{', '.join(STATE_DTYPES)}")
        return dtype_name(dtype)
    return None


def model_spec_from_config(config: Mapping[str, Any], *, assume: str | None = None) -> ModelSpec:
    """The per-layer caches of the model a ``config.json`` dict describes.

    ``assume`` names the family (a supported model_type) that reads a config whose own
    model_type is not supported; the spec then carries a warning saying so.
    """
    if not isinstance(config, Mapping):
        raise ModelConfigError(f"a model config must be a JSON object, got {type(config).__name__}")
    if not config:
        raise ModelConfigError("the config is an empty JSON object; expected a Hugging Face config.json "
                               "(model_type, num_hidden_layers, ...)")
    inner, torch_dtype = _unwrap(config)
    warnings: list[str] = []
    model_type, family, family_name = _family(inner, config, assume, warnings)
    unread = unread_cache_fields(inner, family)
    if unread:
        raise ModelConfigError(
            f"config fields {unread} change what the layers cache, and the {family_name} reader does not read "
            f"them; refusing to guess (model_type {model_type!r})"
        )
    wrapped = ConfigFields(inner, model_type, family, outer=config)
    layers = family.layers(wrapped)
    if not layers:
        raise ModelConfigError(f"config (model_type {model_type!r}) describes no layers")
    warnings += wrapped.warnings
    if torch_dtype is None:
        warnings.append("config has no torch_dtype; assuming bfloat16")
        torch_dtype = "bfloat16"
    for message in warnings:
        logger.warning(message)
    max_positions = wrapped.get("max_position_embeddings")
    return ModelSpec(
        model_type=model_type or "unknown",
        layers=tuple(layers),
        torch_dtype=str(torch_dtype),
        max_position_embeddings=max_positions if isinstance(max_positions, int) else None,
        warnings=tuple(warnings),
        ssm_state_dtype=_ssm_state_dtype(wrapped),
    )
