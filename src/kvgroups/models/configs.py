"""Hugging Face ``config.json`` dicts -> :class:`~kvgroups.models.layers.ModelSpec`.

The config (or its ``text_config``) is read by the family its ``model_type`` names; the families
live in :mod:`kvgroups.models.families`, the mechanism in :mod:`kvgroups.models.config_fields`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvgroups.errors import ModelConfigError
from kvgroups.models import families
from kvgroups.models.config_fields import FAMILIES, GENERIC_FIELDS, ConfigFields, supported_model_types
from kvgroups.models.layers import ModelSpec

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


def model_spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """The per-layer caches of the model a ``config.json`` dict describes."""
    if not isinstance(config, Mapping):
        raise ModelConfigError(f"a model config must be a JSON object, got {type(config).__name__}")
    inner, torch_dtype = _unwrap(config)
    model_type = str(inner.get("model_type") or config.get("model_type") or "")
    warnings: list[str] = []
    family = FAMILIES.get(model_type)
    if family is None and inner.get("kv_lora_rank") is not None:
        family = FAMILIES["deepseek_v3"]
    if family is None:
        missing = [name for name in GENERIC_FIELDS if inner.get(name) is None]
        if missing:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported and the config lacks {missing} to read it "
                f"as llama-like; supported model types: {', '.join(supported_model_types())}"
            )
        message = f"model_type {model_type!r} is not known; reading it as llama-like"
        logger.warning(message)
        warnings.append(message)
        family = FAMILIES["llama"]
    wrapped = ConfigFields(inner, model_type, family)
    layers = family.layers(wrapped)
    if not layers:
        raise ModelConfigError(f"config (model_type {model_type!r}) describes no layers")
    if torch_dtype is None:
        message = "config has no torch_dtype; assuming bfloat16"
        logger.warning(message)
        warnings.append(message)
        torch_dtype = "bfloat16"
    max_positions = wrapped.get("max_position_embeddings")
    return ModelSpec(
        model_type=model_type or "unknown",
        layers=tuple(layers),
        torch_dtype=str(torch_dtype),
        max_position_embeddings=max_positions if isinstance(max_positions, int) else None,
        warnings=tuple(warnings),
    )
