"""kvgroups: describe, group and move the KV caches of large language models.

The public API; LMCache's ``KVLayerGroupInfo`` / ``KVLayerGroupsManager`` / ``LMCacheMetadata``
import from here unchanged. The core (layouts, kinds, layer caches, grouping, groups, metadata)
lives in this package's top-level modules; ``models`` reads model configs, ``datapath`` moves
caches (``kvgroups.transfer`` is its public name), ``store`` keeps chunks, ``integrations`` binds
engines and ``cli`` is the command. Nothing here imports those subpackages, so importing
``kvgroups`` stays light.
"""

from kvgroups.errors import (
    ChunkMismatchError,
    KVGroupsError,
    ModelConfigError,
    SlotMappingError,
    StaleGroupsError,
)
from kvgroups.groups import KVLayerGroupInfo
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
from kvgroups.layer_caches import GroupKey
from kvgroups.layouts import Axis, CacheGeometry, KVLayout, detect_layout, geometry
from kvgroups.manager import KVLayerGroupsManager
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
