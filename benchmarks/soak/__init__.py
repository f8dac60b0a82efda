"""Serving through faults: two ``vllm serve`` on one Valkey/Redis Cluster (``run``), the faults it injects
(``faults``) and its report (``report``)."""
