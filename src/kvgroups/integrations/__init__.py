"""Bindings to serving engines and model libraries (transformers, vLLM); optional extras, never imported by the core."""
