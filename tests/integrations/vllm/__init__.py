"""Tests of kvgroups.integrations.vllm: the connector on vLLM's real Scheduler and engines, vllm serve, P/D."""
