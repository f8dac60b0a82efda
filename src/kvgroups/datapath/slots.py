"""One call's slots, checked: the token range, where its tokens sit per block size, its state slots.

Every kernel reads a call through :class:`CallSlots`; nothing here copies cache data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ARANGE: dict[int, torch.Tensor] = {}


@dataclass(frozen=True)
class TokenPlan:
    """Where a token range lives in caches of one block size (tensors on the caches' device).

    The first ``num_block_tokens`` tokens fill whole blocks ``block_ids`` (the range starts on a
    block boundary and runs through each block in order); ``blocks``/``offsets`` locate every
    token.
    """

    num_tokens: int
    num_block_tokens: int
    block_ids: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor


def plan_tokens(slots: torch.Tensor, cpu_slots: torch.Tensor, block_size: int) -> TokenPlan:
    """The :class:`TokenPlan` of ``slots`` (on the caches' device; ``cpu_slots`` the same on the CPU)."""
    num_tokens = cpu_slots.shape[0]
    full_blocks = num_tokens // block_size
    aligned = False
    if full_blocks:
        arange = _ARANGE.get(block_size)
        if arange is None:
            arange = _ARANGE[block_size] = torch.arange(block_size)
        head = cpu_slots[: full_blocks * block_size].view(full_blocks, block_size)
        first = head[:, :1]
        aligned = bool(((first % block_size == 0) & (head - first == arange)).all())
    num_block_tokens = full_blocks * block_size if aligned else 0
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    return TokenPlan(
        num_tokens=num_tokens,
        num_block_tokens=num_block_tokens,
        block_ids=blocks[:num_block_tokens:block_size],
        blocks=blocks,
        offsets=slots - blocks * block_size,
    )


class CallSlots:
    """A call's checked slots, as NumPy int64 arrays (``slot_values``: token slots, ``state_values``: state
    slots, None where no group needs them); as tensors on the caches' device only when a kernel asks."""

    def __init__(self, device: torch.device, slot_values: np.ndarray | None, state_values: np.ndarray | None,
                 device_slots: torch.Tensor | None = None) -> None:
        self.device = device
        self.slot_values = slot_values
        self.state_values = state_values
        self._slots = device_slots  # the caller's own tensor, when it is on the caches' device already
        self._state_indices: torch.Tensor | None = None
        self._plans: dict[int, TokenPlan] = {}

    @property
    def num_tokens(self) -> int:
        return 0 if self.slot_values is None else int(self.slot_values.shape[0])

    @property
    def num_states(self) -> int:
        return 0 if self.state_values is None else int(self.state_values.shape[0])

    @property
    def cpu_slots(self) -> torch.Tensor | None:
        return None if self.slot_values is None else torch.from_numpy(self.slot_values)

    @property
    def slots(self) -> torch.Tensor | None:
        """The token slots on the caches' device (uploaded once, from pinned memory on a GPU)."""
        if self._slots is None and self.slot_values is not None:
            self._slots = _on_device(torch.from_numpy(self.slot_values), self.device)
        return self._slots

    @property
    def state_indices(self) -> torch.Tensor | None:
        if self._state_indices is None and self.state_values is not None:
            self._state_indices = _on_device(torch.from_numpy(self.state_values), self.device)
        return self._state_indices

    def plan(self, block_size: int) -> TokenPlan | None:
        """The tokens' plan for caches of ``block_size`` (built once per block size), None without slots."""
        slots, cpu_slots = self.slots, self.cpu_slots
        if slots is None or cpu_slots is None:
            return None
        plan = self._plans.get(block_size)
        if plan is None:
            plan = self._plans[block_size] = plan_tokens(slots, cpu_slots, block_size)
        return plan


def _on_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # from pinned memory the upload is queued on the stream, not waited for
        return values.pin_memory().to(device, non_blocking=True)
    return values if values.device == device else values.to(device)


def paged_slots(positions: np.ndarray, block_ids: np.ndarray, block_size: int) -> np.ndarray:
    """The slots (``block_id * block_size + offset``, vLLM's convention) of token ``positions`` of a
    sequence whose blocks are ``block_ids``; -1 where no block holds the token (past the table, or
    the null block 0 that engines leave where a window has moved on)."""
    index = positions // block_size
    inside = index < block_ids.size
    blocks = np.zeros(positions.shape, dtype=np.int64)
    blocks[inside] = block_ids[index[inside]]
    return np.where(blocks > 0, blocks * block_size + positions % block_size, -1)
