"""The benchmarks, in rooms that mirror the package (``make bench`` runs them all; docs/benchmarks.md has every
table). Each is a module run from the repository root with an environment's Python, for example
``.venv/bin/python -m benchmarks.datapath.transfer``:

- ``core``: layer groups' lookups against LMCache's.
- ``datapath``: ``KVTransfer`` against ``copy_`` (``transfer``), the GPU check (``gpu_check``, ``make gpu-check``).
- ``store``: every tier against its raw medium (``tiers``), keyed hashes and AEADs (``macs``), a cluster's
  failovers (``failover``).
- ``integrations.transformers``: time to first token with reuse (``reuse``), the restore check's cost.
- ``integrations.vllm``: engines and ``vllm serve`` with the connector (``reuse``, ``serving``, ``conversations``,
  ``pd_serving``, ``early_loads``, ``kv_events``, ``gpu_engines``).
- ``integrations.sglang``: the HiCache L3 backend against SGLang's own (``storage``).
- ``soak``: two ``vllm serve`` on one cluster through every fault (``run``; its ``faults`` and ``report``).
- ``support``: what they share: the benchmark models, local Valkey/Redis servers, the row of what could not be
  measured.
"""
