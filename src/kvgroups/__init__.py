"""kvgroups: describe, group and move the KV caches of large language models.

The public API; LMCache's ``KVLayerGroupInfo`` / ``KVLayerGroupsManager`` / ``LMCacheMetadata``
import from here unchanged.
"""

from kvgroups.build import GroupKey
from kvgroups.errors import (
    ChunkMismatchError,
    KVGroupsError,
    ModelConfigError,
    SlotMappingError,
    StaleGroupsError,
)
from kvgroups.groups import KVLayerGroupInfo, KVLayerGroupsManager
from kvgroups.kinds import (
    ChunkedLocal,
    FullAttention,
    LayerCacheSpec,
    LayerKind,
    MLAttention,
    RecurrentState,
    SlidingWindow,
    spec_from_dict,
)
from kvgroups.layouts import Axis, CacheGeometry, KVLayout, detect_layout, geometry
from kvgroups.metadata import LMCacheMetadata

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "CacheGeometry",
    "ChunkMismatchError",
    "ChunkedLocal",
    "FullAttention",
    "GroupKey",
    "KVGroupsError",
    "KVLayerGroupInfo",
    "KVLayerGroupsManager",
    "KVLayout",
    "LMCacheMetadata",
    "LayerCacheSpec",
    "LayerKind",
    "MLAttention",
    "ModelConfigError",
    "RecurrentState",
    "SlidingWindow",
    "SlotMappingError",
    "StaleGroupsError",
    "detect_layout",
    "geometry",
    "spec_from_dict",
]
