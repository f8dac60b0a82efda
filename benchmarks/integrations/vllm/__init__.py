"""Benchmarks of KVGroupsConnector on vLLM's CPU engine and ``vllm serve``: stored prefixes (``reuse``), many users
(``serving``), long conversations (``conversations``), disaggregated prefill (``pd_serving``), loads started early
(``early_loads``), KV events (``kv_events``), and the engine rows of the GPU check (``gpu_engines``)."""
