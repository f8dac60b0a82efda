"""The data path: moving token ranges and states between an engine's caches and chunk tensors."""
