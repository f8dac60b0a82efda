"""The vLLM KV connector (``kvgroups[vllm]``): ``kv_connector_module_path="kvgroups.integrations.vllm"``.

``KVGroupsConnector`` and ``flush_saves`` import vLLM when first asked for (vLLM looks the class up
by name); the modules that need no vLLM (the background loads) import without it. Nothing outside
this package imports vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgroups.integrations.vllm.connector import KVGroupsConnector, flush_saves

__all__ = ["KVGroupsConnector", "flush_saves"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvgroups.integrations.vllm.connector"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
