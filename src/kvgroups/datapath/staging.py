"""Chunks a kernel cannot address where they are: the copies across devices, issued ``non_blocking``.

The Triton kernels read and write chunks in pinned host memory themselves; a chunk anywhere else
(pageable host memory, another device), or any chunk of a kernel that addresses only the caches'
device (the torch path on a GPU), goes through a buffer on the caches' device. A copy between a CUDA
device and pinned host memory may run asynchronously: :class:`Staging` says whether one did, and the
call then synchronizes once (:meth:`~kvgroups.datapath.transfer.Launched.release`).
"""

from __future__ import annotations

import torch


class Staging:
    """Copies between chunks and the caches' device for one call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.asynchronous = False
        self.uploads = 0  # chunks copied to the caches' device

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
        self.uploads += 1
        return staged
