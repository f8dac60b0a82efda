"""The project's exceptions: each derives from the builtin a caller would catch anyway."""

from __future__ import annotations


class KVGroupsError(ValueError):
    """A value handed to kvgroups is wrong; the message names it and what was expected."""


class StaleGroupsError(KVGroupsError):
    """Groups were built already and new caches would group differently."""


class SlotMappingError(KVGroupsError):
    """A slot mapping points outside the caches or maps two tokens to one slot."""


class ChunkMismatchError(KVGroupsError):
    """A chunk tensor's shape, dtype or device does not match its group."""


class ModelConfigError(KVGroupsError):
    """A model config.json cannot be turned into per-layer cache specs."""


class UnsupportedCacheError(KVGroupsError):
    """An engine's cache (transformers', vLLM's) holds something kvgroups cannot store and restore exactly."""
