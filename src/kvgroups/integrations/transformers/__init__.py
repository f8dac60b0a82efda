"""Prefix reuse for transformers causal LMs (``pip install 'kvgroups[transformers]'``).

``PrefixCache(model, store)`` reuses stored prefixes in ``prefill`` / ``generate``; the model's
cache is read as kvgroups layer caches by :mod:`.cache_parts`, and which model types are right
to reuse is :mod:`.support`'s call. Importing this package imports transformers.
"""

from kvgroups.errors import UnsupportedCacheError
from kvgroups.integrations.transformers.prefix_cache import PrefillResult, PrefixCache
from kvgroups.integrations.transformers.support import (
    REFUSED_MODEL_TYPES,
    VERIFIED_MODEL_TYPES,
    UnsupportedModelError,
)

__all__ = [
    "REFUSED_MODEL_TYPES",
    "VERIFIED_MODEL_TYPES",
    "PrefillResult",
    "PrefixCache",
    "UnsupportedCacheError",
    "UnsupportedModelError",
]
