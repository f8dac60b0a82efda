"""Benchmarks of the integrations, one room per engine: ``transformers``, ``vllm``, ``sglang``."""
