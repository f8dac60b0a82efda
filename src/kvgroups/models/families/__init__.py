"""Every supported model family's config reader; importing this package registers them all."""

from kvgroups.models.families import attention, compressed, decoders, hybrid, linear, mamba, mla, per_layer, sliding

__all__ = ["attention", "compressed", "decoders", "hybrid", "linear", "mamba", "mla", "per_layer", "sliding"]
