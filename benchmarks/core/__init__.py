"""Benchmarks of the core: layer groups and metadata (``groups``)."""
