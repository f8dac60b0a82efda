"""Benchmarks of the SGLang HiCache storage backend against SGLang's own file backend (``storage``)."""
