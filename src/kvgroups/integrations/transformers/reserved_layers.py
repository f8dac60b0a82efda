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
        self._hold(key_buffer, value_buffer, length)

    def _hold(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        self.keys, self.values = key_buffer[..., :length, :], value_buffer[..., :length, :]
        self._views = (self.keys, self.values)

    def _reserved(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers while the layer's keys and values are still the views its own updates set; else None
        (replaced by anything else, the buffers no longer say what it holds)."""
        if self._buffers is None or self.keys is not self._views[0] or self.values is not self._views[1]:
            return None
        return self._buffers

    def _fits(self, buffers: tuple[torch.Tensor, torch.Tensor], key_states: torch.Tensor,
              value_states: torch.Tensor) -> bool:
        key_buffer, value_buffer = buffers
        return (self.keys.shape[-2] + key_states.shape[-2] <= key_buffer.shape[-2]
                and key_states.shape[-2] == value_states.shape[-2]
                and key_states.shape[:-2] == key_buffer.shape[:-2] and key_states.shape[-1] == key_buffer.shape[-1]
                and value_states.shape[:-2] == value_buffer.shape[:-2]
                and value_states.shape[-1] == value_buffer.shape[-1]
                and key_states.dtype == key_buffer.dtype and value_states.dtype == value_buffer.dtype
                and key_states.device == key_buffer.device and value_states.device == value_buffer.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        buffers = self._reserved()
        if buffers is None or not self._fits(buffers, key_states, value_states):
            self._buffers = None  # from now on a plain DynamicLayer
            return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[no-any-return]
        key_buffer, value_buffer = buffers
        held = self.keys.shape[-2]
        end = held + key_states.shape[-2]
        # Behind the tokens held: no tensor handed out before (a view of the first tokens) changes.
        key_buffer[..., held:end, :].copy_(key_states)
        value_buffer[..., held:end, :].copy_(value_states)
        self._hold(key_buffer, value_buffer, end)
        return self.keys, self.values

    @property
    def reserved_tokens(self) -> int:
        """Tokens an update may still write in place (0 once it fell back to ``DynamicLayer``)."""
        buffers = self._reserved()
        return 0 if buffers is None else buffers[0].shape[-2] - self.keys.shape[-2]
