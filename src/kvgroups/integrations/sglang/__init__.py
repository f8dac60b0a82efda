"""kvgroups as an SGLang HiCache storage backend (``kvgroups[sglang]``), loaded by SGLang itself:

``--enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
'{"backend_name": "kvgroups", "module_path": "kvgroups.integrations.sglang", "class_name":
"KVGroupsHiCacheStorage", "store": "file:///var/cache/kv"}'``

``KVGroupsHiCacheStorage`` imports SGLang when first asked for (SGLang looks the class up by name);
the settings and the pools' description import without it. Nothing outside this package imports SGLang.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgroups.integrations.sglang.storage import KVGroupsHiCacheStorage

__all__ = ["KVGroupsHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvgroups.integrations.sglang.storage"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
