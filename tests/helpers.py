"""Shared helpers for the tests."""

from __future__ import annotations

import torch


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor that has a shape and dtype but no storage."""
    return torch.empty(*shape, dtype=dtype, device="meta")
