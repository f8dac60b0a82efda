"""Test-wide settings: Triton kernels run under Triton's interpreter where there is no GPU."""

from __future__ import annotations

import os

import torch

# Triton reads this when a kernel is decorated, so it is set before kvgroups' Triton module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
