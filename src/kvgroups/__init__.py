"""kvgroups: describe, group and move the KV caches of large language models.

The public API; LMCache's ``KVLayerGroupInfo`` / ``KVLayerGroupsManager`` / ``LMCacheMetadata``
import from here unchanged. The subpackages are the layers, each building on those before it:
``core`` (layouts, layer-cache specs, groups, metadata), ``models`` (the offline model catalogue
``inspect`` reads), ``datapath`` (moves caches; ``kvgroups.transfer`` is its public name),
``store`` (keeps chunks), ``integrations`` (binds engines) and ``cli`` (the command). Importing
``kvgroups`` loads the core only.
"""

from kvgroups.core.cache_specs import (
    ChunkedLocal,
    FullAttention,
    LayerCacheSpec,
    LayerKind,
    MLAttention,
    RecurrentState,
    SlidingWindow,
    spec_from_dict,
)
from kvgroups.core.group_keys import GroupKey
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.layouts import Axis, CacheGeometry, KVLayout, detect_layout, geometry
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.core.row_specs import CompressedRows, WindowPages
from kvgroups.errors import (
    ChunkMismatchError,
    KVGroupsError,
    ModelConfigError,
    SlotMappingError,
    StaleGroupsError,
)

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "CacheGeometry",
    "ChunkMismatchError",
    "ChunkedLocal",
    "CompressedRows",
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
    "WindowPages",
    "detect_layout",
    "geometry",
    "spec_from_dict",
]
