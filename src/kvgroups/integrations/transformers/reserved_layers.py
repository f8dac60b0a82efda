"""A full-attention cache layer restored with room for the tokens the prefill computes next.

transformers' ``DynamicLayer`` grows by ``torch.cat``: the suffix's forward after a restore copies
every restored token once more into a new tensor (and page-faults it in), per layer, where the
tokens it computes are all that is new. :class:`ReservedDynamicLayer` is a ``DynamicLayer`` whose
keys and values are views of buffers with room for those tokens: an update that fits is written
in place behind the tokens held; anything else (more tokens than the room, another shape, keys
that something other than its own update replaced: a crop, a batch reorder, an offload) falls back
to ``DynamicLayer``'s own update, which copies as before.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class ReservedDynamicLayer(DynamicLayer):  # type: ignore[misc]
    """A ``DynamicLayer`` holding the first ``length`` tokens of ``key_buffer`` / ``value_buffer``
    (``[batch, heads, capacity, head_dim]``), later updates written into the rest while they fit."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        super().__init__()
        if key_buffer.shape[-2] != value_buffer.shape[-2] or not 0 <= length <= key_buffer.shape[-2]:
            raise ValueError(f"buffers of {key_buffer.shape[-2]} and {value_buffer.shape[-2]} tokens cannot hold "
                             f"{length}; both need room for at least that many")
        self.device = key_buffer.device
        self.is_initialized = True
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = (key_buffer, value_buffer)
        self._length = length
        self._hold(length)

    def _hold(self, length: int) -> None:
        if self._buffers is None:  # pragma: no cover - only called while reserved
            return
        key_buffer, value_buffer = self._buffers
        self.keys, self.values = key_buffer[..., :length, :], value_buffer[..., :length, :]
        self._views = (self.keys, self.values)
        self._length = length

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        if self._buffers is None:
            return False
        key_buffer, value_buffer = self._buffers
        # Keys replaced by anything but this layer's own update: the buffers no longer say what it holds.
        if self.keys is not self._views[0] or self.values is not self._views[1]:
            return False
        return (self._length + key_states.shape[-2] <= key_buffer.shape[-2]
                and key_states.shape[-2] == value_states.shape[-2]
                and key_states.shape[:-2] == key_buffer.shape[:-2] and key_states.shape[-1] == key_buffer.shape[-1]
                and value_states.shape[:-2] == value_buffer.shape[:-2]
                and value_states.shape[-1] == value_buffer.shape[-1]
                and key_states.dtype == key_buffer.dtype and value_states.dtype == value_buffer.dtype
                and key_states.device == key_buffer.device and value_states.device == value_buffer.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(key_states, value_states):
            self._buffers = None  # from now on a plain DynamicLayer
            return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[no-any-return]
        key_buffer, value_buffer = self._buffers  # type: ignore[misc]
        end = self._length + key_states.shape[-2]
        # Behind the tokens held: no tensor handed out before (a view of the first tokens) changes.
        key_buffer[..., self._length:end, :].copy_(key_states)
        value_buffer[..., self._length:end, :].copy_(value_states)
        self._hold(end)
        return self.keys, self.values

    @property
    def reserved_tokens(self) -> int:
        """Tokens an update may still write in place (0 once it fell back to ``DynamicLayer``)."""
        if self._buffers is None or self.keys is not self._views[0] or self.values is not self._views[1]:
            return 0
        return self._buffers[0].shape[-2] - self._length
