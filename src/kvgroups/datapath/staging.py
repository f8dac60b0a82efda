"""Chunks on another device than the caches: the copies across, issued once, and one synchronize.

GPU caches are typically packed into pinned CPU chunks and unpacked from them. A copy between a
CUDA device and pinned host memory may run asynchronously; :class:`Staging` issues every such
copy ``non_blocking`` and synchronizes once at the end, so the chunks are safe to read (after
``pack``) or to refill (after ``unpack``) when the call returns.
"""

from __future__ import annotations

import torch


class Staging:
    """Copies between chunks and the caches' device for one call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = False

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``, asynchronous when one side is pinned host memory and the other CUDA."""
        non_blocking = self.device.type == "cuda" and (target.is_pinned() or source.is_pinned())
        target.copy_(source, non_blocking=non_blocking)
        self.asynchronous |= non_blocking

    def on_device(self, chunk: torch.Tensor) -> torch.Tensor:
        """``chunk`` itself when it is on the caches' device, else a copy there."""
        if chunk.device == self.device:
            return chunk
        staged = torch.empty_like(chunk, device=self.device)
        self.copy(staged, chunk)
        return staged

    def buffer_for(self, chunk: torch.Tensor) -> torch.Tensor:
        """Where to gather into for ``chunk``: itself on the caches' device, else a buffer there."""
        return chunk if chunk.device == self.device else torch.empty_like(chunk, device=self.device)

    def finish(self) -> None:
        """Wait for the asynchronous copies, so the chunks may be read or refilled."""
        if self.asynchronous:
            torch.cuda.current_stream(self.device).synchronize()
