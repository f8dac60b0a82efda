"""Chunks a kernel cannot address where they are: the copies across devices, issued ``non_blocking``.

The Triton kernels read and write chunks in pinned host memory themselves; a chunk anywhere else
(pageable host memory, another device), or any chunk of a kernel that addresses only the caches'
device (the torch path on a GPU), goes through a buffer on the caches' device. A copy between a CUDA
device and pinned host memory may run asynchronously: :class:`Staging` says whether one did, and the
call then synchronizes once (:meth:`~kvgroups.datapath.transfer.Launched.release`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvgroups.errors import ChunkMismatchError


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


def gather_buffer(device: torch.device, index: int, chunk: torch.Tensor, staging: Sequence[torch.Tensor] | None,
                  num_groups: int) -> torch.Tensor:
    """Where group ``index``'s chunk is gathered on ``device`` before it is copied to ``chunk``'s: its buffer of
    ``staging`` (one per group, uint8, at least the chunk's bytes), else a temporary one."""
    if staging is None:
        return torch.empty_like(chunk, device=device)
    if len(staging) != num_groups:
        raise ChunkMismatchError(f"staging has {len(staging)} buffers for {num_groups} groups")
    buffer = staging[index]
    needed = chunk.numel() * chunk.element_size()
    if (not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.device != device
            or not buffer.is_contiguous() or buffer.numel() < needed):
        raise ChunkMismatchError(f"staging for group {index} must be a contiguous uint8 tensor of at least "
                                 f"{needed} bytes on {device}")
    return buffer[:needed].view(chunk.dtype).view(chunk.shape)
