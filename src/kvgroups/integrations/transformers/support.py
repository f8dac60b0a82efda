"""Which transformers models prefix reuse is right for, and a model's identity for the store.

Reuse is offered only for model types whose continuation from a restored cache was checked to
equal recomputing (the test suite builds a tiny random-weight model of each and compares logits
and greedy tokens); known failures are refused with the reason, anything else is refused as
unchecked. A model's identity in the store binds its name, a digest of its weights and the
transformers version (which decides what a cache holds), so that two models that share a config
but not their weights never share entries.
"""

from __future__ import annotations

from typing import Any

import transformers

from kvgroups.errors import KVGroupsError
from kvgroups.models.transformers_types import sweep_data
from kvgroups.store.entries.identity import model_identity as identity
from kvgroups.store.entries.identity import tensors_digest

# Which model types reuse was checked right for, and why the others are refused, as the sweep over
# every causal-LM type found (tests/models/test_model_type_sweep.py keeps models/transformers_types.json current).
_VERDICTS = sweep_data().prefix_cache_verdicts()
VERIFIED_MODEL_TYPES = frozenset(name for name, verdict in _VERDICTS.items() if verdict.verified)
REFUSED_MODEL_TYPES = {name: verdict.reason for name, verdict in sorted(_VERDICTS.items()) if not verdict.verified}
CHECKED_WITH = sweep_data().transformers


class UnsupportedModelError(KVGroupsError):
    """A model whose restored caches would not continue exactly as recomputing."""


def model_type_of(model: Any) -> str:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return str(getattr(config, "model_type", "") or model.config.model_type)


def check_supported(model: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless prefix reuse was checked right for ``model``'s type."""
    model_type = model_type_of(model)
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(f"prefix reuse is refused for model_type {model_type!r}: "
                                    f"{REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in VERIFIED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"prefix reuse has not been checked for model_type {model_type!r} (not a causal-LM type of transformers "
            f"{CHECKED_WITH}); checked: {', '.join(sorted(VERIFIED_MODEL_TYPES))}"
        )


def model_identity(model: Any) -> str:
    """The name a model's chunks are stored under (:mod:`kvgroups.store.entries.identity`'s format): its name
    or path, :func:`~kvgroups.store.entries.identity.tensors_digest` of its weights, the transformers version."""
    name = getattr(model.config, "_name_or_path", "") or model_type_of(model)
    weights = tensors_digest([*model.named_parameters(), *model.named_buffers()])
    return identity(name, f"weights-{weights}", "transformers", transformers.__version__)
