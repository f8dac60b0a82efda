"""Every supported model family's config reader; importing this package registers them all."""

from kvgroups.models.families import attention, hybrid, mla

__all__ = ["attention", "hybrid", "mla"]
