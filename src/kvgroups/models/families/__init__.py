"""Every supported model family's config reader; importing this package registers them all."""

from kvgroups.models.families import attention, hybrid, mamba, mla, per_layer

__all__ = ["attention", "hybrid", "mamba", "mla", "per_layer"]
