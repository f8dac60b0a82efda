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
from kvgroups.store.identity import model_identity as identity
from kvgroups.store.identity import tensors_digest

# Checked with transformers 5.24 (tests/test_transformers_reuse.py builds each of them).
VERIFIED_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2",
    "gemma", "gemma2", "gemma3_text",
    "deepseek_v3",
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
    "bamba", "falcon_h1", "nemotron_h", "granitemoehybrid", "zamba2", "mamba2",
    "lfm2",
})

# What goes wrong, measured with transformers 5.24, for model types that are refused outright.
REFUSED_MODEL_TYPES = {
    "jamba": "its mamba (v1) layers ignore a restored SSM state in multi-token forwards, so a continued or "
             "chunk-by-chunk prefill differs from recomputing",
    "mamba": "its mamba (v1) layers ignore a restored SSM state in multi-token forwards",
    "falcon_mamba": "its mamba (v1) layers ignore a restored SSM state in multi-token forwards",
    "zamba": "its mamba (v1) layers ignore a restored SSM state in multi-token forwards",
    "minimax": "it keeps its lightning-attention state in a cache class of its own",
    "recurrent_gemma": "it keeps its recurrent state on the modules, not in the cache",
    "xlstm": "it keeps its state in a cache class of its own",
    "reformer": "it keeps its state in a cache class of its own",
}

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
            f"prefix reuse has not been checked for model_type {model_type!r}; checked: "
            f"{', '.join(sorted(VERIFIED_MODEL_TYPES))}"
        )


def model_identity(model: Any) -> str:
    """The name a model's chunks are stored under (:mod:`kvgroups.store.identity`'s format): its name
    or path, :func:`~kvgroups.store.identity.tensors_digest` of its weights, the transformers version."""
    name = getattr(model.config, "_name_or_path", "") or model_type_of(model)
    weights = tensors_digest([*model.named_parameters(), *model.named_buffers()])
    return identity(name, f"weights-{weights}", "transformers", transformers.__version__)
