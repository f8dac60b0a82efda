"""The vLLM KV connector (``kvgroups[vllm]``): ``kv_connector_module_path="kvgroups.integrations.vllm"``.

Importing this package imports vLLM; nothing outside it does.
"""

from kvgroups.integrations.vllm.connector import KVGroupsConnector, flush_saves

__all__ = ["KVGroupsConnector", "flush_saves"]
