"""Which kernel copies a bound transfer's groups: numba on the CPU, Triton on CUDA, torch anywhere.

The default is the fastest kernel that can run on the caches' device: numba for CPU caches,
Triton for CUDA caches, the torch path otherwise (and wherever the kernel's package is not
importable). ``KVGROUPS_KERNEL=numba|triton|torch`` (or ``KVTransfer(..., kernel=)``) forces one
for any device; a forced kernel that cannot run raises, it never falls back. Triton on CPU
tensors runs only under its interpreter (``TRITON_INTERPRET=1``), which the tests use. A group
whose tensors no address table can describe (layers of different strides, a state whose slots are
not contiguous) is copied by the torch path, whatever the kernel; ``KVTransfer.kernels`` says
which kernel serves each group.

numba and Triton are imported here lazily, only when a kernel is chosen.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from kvgroups.core.group_keys import Tensors
from kvgroups.core.layouts import KVLayout
from kvgroups.datapath.address_tables import amx_table, state_table, token_tables
from kvgroups.datapath.run_queue import RunCopier
from kvgroups.datapath.slots import CallSlots
from kvgroups.datapath.torch_copy import StateCopier, TokenCopier
from kvgroups.errors import KVGroupsError

KERNELS = ("numba", "triton", "torch")
ENVIRONMENT_VARIABLE = "KVGROUPS_KERNEL"


class SlowCopier(Protocol):
    """Moves one group's data between its caches and a chunk for one checked call, when called."""

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None: ...


# A group's copier: one that copies when called (numba, torch), or one that queues runs for one launch (Triton).
Copier = SlowCopier | RunCopier


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cannot_run(kernel: str, device: torch.device) -> str | None:
    """Why ``kernel`` cannot copy caches on ``device``, or None when it can."""
    if kernel == "numba":
        if device.type != "cpu":
            return f"the numba kernel copies CPU memory; these caches are on {device}"
        if not _importable("numba"):
            return "numba is not importable (pip install numba)"
    if kernel == "triton":
        if not _importable("triton"):
            return "triton is not importable (CUDA builds of torch ship it; pip install triton)"
        if device.type == "cpu" and not _triton_interpreted():
            return "the Triton kernel runs on CPU tensors only under its interpreter: set TRITON_INTERPRET=1"
        if device.type not in ("cpu", "cuda"):
            return f"the Triton kernel copies CUDA memory; these caches are on {device}"
    return None


def choose_kernel(device: torch.device, requested: str | None = None) -> str:
    """The kernel for caches on ``device``: ``requested``, else ``$KVGROUPS_KERNEL``, else the default."""
    forced = requested or os.environ.get(ENVIRONMENT_VARIABLE) or None
    if forced is not None:
        if forced not in KERNELS:
            raise KVGroupsError(
                f"unknown kernel {forced!r} (from {'kernel=' if requested else ENVIRONMENT_VARIABLE}); "
                f"expected one of {', '.join(KERNELS)}"
            )
        reason = _cannot_run(forced, device)
        if reason is not None:
            raise KVGroupsError(f"kernel {forced!r} was asked for but cannot run: {reason}")
        return forced
    preferred = {"cpu": "numba", "cuda": "triton"}.get(device.type, "torch")
    return preferred if _cannot_run(preferred, device) is None else "torch"


def token_copier(kernel: str, layout: KVLayout, block_size: int, layers: Sequence[Tensors],
                 num_threads: int | None, value_head_size: int | None = None, num_slots: int = 0) -> tuple[str, Copier]:
    """The copier of one token-indexed group (of ``num_slots`` token slots), and the kernel it uses."""
    if layout is KVLayout.VLLM_CPU_AMX and kernel == "numba":
        table = amx_table(layers)
        if table is not None:
            from kvgroups.datapath.numba_amx import NumbaAmxCopier  # noqa: PLC0415 - numba loads on use

            return kernel, NumbaAmxCopier(table, num_threads)
    tables = None if kernel == "torch" else token_tables(layout, layers, value_head_size)
    if tables is not None and kernel == "numba":
        from kvgroups.datapath.lockstep import choose  # noqa: PLC0415 - numba/triton load on use
        from kvgroups.datapath.numba_copy import NumbaTokenCopier  # noqa: PLC0415

        copier = NumbaTokenCopier(tables, block_size, num_threads)
        copier.lockstep = choose(copier, num_slots)
        return kernel, copier
    if tables is not None and kernel == "triton":
        from kvgroups.datapath.triton_copy import TritonTokenCopier  # noqa: PLC0415 - numba/triton load on use

        return kernel, TritonTokenCopier(tables, block_size)
    return "torch", TokenCopier(layout, block_size, layers, value_head_size)


def state_copier(kernel: str, layers: Sequence[Tensors]) -> tuple[str, Copier]:
    """The copier of one recurrent group, and the kernel it uses."""
    table = None if kernel == "torch" else state_table(layers)
    if table is not None and kernel == "numba":
        from kvgroups.datapath.numba_copy import NumbaStateCopier  # noqa: PLC0415 - numba/triton load on use

        return kernel, NumbaStateCopier(table)
    if table is not None and kernel == "triton":
        from kvgroups.datapath.triton_copy import TritonStateCopier  # noqa: PLC0415 - numba/triton load on use

        return kernel, TritonStateCopier(table)
    return "torch", StateCopier(layers)


def warm_up(device: torch.device | str = "cpu") -> str:
    """Compile the kernel caches on ``device`` will use, now rather than in their first copy; its name."""
    kernel = choose_kernel(torch.device(device))
    if kernel == "numba":
        from kvgroups.datapath.numba_amx import warm_up as compile_amx  # noqa: PLC0415 - numba loads on use
        from kvgroups.datapath.numba_copy import warm_up as compile_numba  # noqa: PLC0415 - numba loads on use

        compile_numba()
        compile_amx()
    return kernel

