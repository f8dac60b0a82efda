"""What a layer's cache holds: one small frozen spec per kind of layer.

Two layers can only share a group when their specs are equal, because the rules for reusing
their caches differ: a full-attention layer needs every earlier token, a sliding-window layer
only the last ``window_tokens``, a recurrent layer one state per sequence. Each spec answers
for itself (``token_indexed``, ``tokens_held``, ``accepts_layout``, its byte counts); nothing
switches on the kind.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kvgroups.core.checks import is_int_at_least
from kvgroups.core.layouts import KVLayout
from kvgroups.core.sizes import round_up
from kvgroups.errors import KVGroupsError


class LayerKind(enum.Enum):
    """Kinds of layer cache."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MLA = "mla"
    COMPRESSED = "compressed"
    WINDOW_PAGES = "window_pages"
    RECURRENT = "recurrent"


class LayerCacheSpec(Protocol):
    """What every spec provides."""

    kind: ClassVar[LayerKind]
    # True: addressed by token slots; False: one fixed-size state per sequence, moved by state slot.
    token_indexed: ClassVar[bool]
    # True: a sequence's cache keeps every one of its tokens (full attention, MLA latents).
    keeps_every_token: ClassVar[bool]

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-slot shape of each state tensor of a recurrent layer; empty for token caches."""
        ...

    @property
    def state_elements(self) -> int:
        """Elements one sequence's state holds, all state tensors together (0 for token caches)."""
        ...

    def accepts_layout(self, layout: KVLayout) -> bool:
        """Whether a cache in ``layout`` can hold this kind."""
        ...

    def tokens_held(self, context_tokens: int, block_size: int) -> int:
        """Token slots one sequence of ``context_tokens`` occupies (0 for recurrent state)."""
        ...

    def tokens_needed(self, boundary: int) -> tuple[int, int]:
        """The tokens ``[start, end)`` whose K/V a layer needs after ``boundary`` (none: a recurrent state)."""
        ...

    def bytes_per_token(self, slot_bytes: int) -> float:
        """What one more token of context costs a layer whose slot holds ``slot_bytes`` (a fraction where
        one slot serves several tokens: an int otherwise)."""
        ...

    def slot_range(self, start: int, end: int) -> tuple[int, int]:
        """The slots ``[first, last)`` the tokens ``[start, end)`` completed (the tokens themselves, or the
        compressed rows whose last token lies among them)."""
        ...

    def chunk_slots(self, num_tokens: int) -> int:
        """Slots a stored chunk of ``num_tokens`` tokens has room for (one state for a recurrent layer)."""
        ...

    def bytes_per_sequence(self, slot_bytes: int) -> int:
        """What one more sequence costs such a layer, whatever its length (its recurrent state)."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, ``{"kind": ..., **parameters}``."""
        ...


_FROM_DICT: dict[LayerKind, Callable[[Mapping[str, Any]], LayerCacheSpec]] = {}


def registered(cls: Any) -> Any:
    """Register a spec class for :func:`spec_from_dict` (kinds defined in other modules use it too)."""
    _FROM_DICT[cls.kind] = cls.from_dict
    return cls


def positive_int(owner: str, field_name: str, value: object) -> int:
    if not is_int_at_least(value, 1):
        raise KVGroupsError(f"{owner}.{field_name} must be a positive int, got {value!r}")
    return value


class TokenCache:
    """What every token-indexed kind shares: one slot per token, nothing per sequence."""

    token_indexed: ClassVar[bool] = True
    keeps_every_token: ClassVar[bool] = False

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ()

    @property
    def state_elements(self) -> int:
        return 0

    def accepts_layout(self, layout: KVLayout) -> bool:
        return layout.holds_kv

    def bytes_per_token(self, slot_bytes: int) -> float:
        return slot_bytes

    def bytes_per_sequence(self, slot_bytes: int) -> int:
        return 0

    def tokens_needed(self, boundary: int) -> tuple[int, int]:
        return 0, boundary

    def slot_range(self, start: int, end: int) -> tuple[int, int]:
        return start, end

    def chunk_slots(self, num_tokens: int) -> int:
        return num_tokens


class EveryToken(TokenCache):
    """What the kinds that keep every token of a sequence share."""

    keeps_every_token: ClassVar[bool] = True

    def tokens_held(self, context_tokens: int, block_size: int) -> int:
        return context_tokens


@registered
@dataclass(frozen=True, kw_only=True)
class FullAttention(EveryToken):
    """Keys and values of every token of the sequence."""

    kind: ClassVar[LayerKind] = LayerKind.FULL_ATTENTION

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FullAttention:
        return cls()


@registered
@dataclass(frozen=True, kw_only=True)
class SlidingWindow(TokenCache):
    """Keys and values of the last ``window_tokens`` tokens only."""

    kind: ClassVar[LayerKind] = LayerKind.SLIDING_WINDOW
    window_tokens: int

    def __post_init__(self) -> None:
        positive_int("SlidingWindow", "window_tokens", self.window_tokens)

    def accepts_layout(self, layout: KVLayout) -> bool:
        # A window of single rows too: one K=V head (DeepSeek-V4), a compressor's per-token state.
        return layout.holds_kv or layout is KVLayout.MLA

    def tokens_held(self, context_tokens: int, block_size: int) -> int:
        # The window rarely starts on a block boundary, so one more block stays partly live.
        return min(context_tokens, round_up(self.window_tokens, block_size) + block_size)

    def tokens_needed(self, boundary: int) -> tuple[int, int]:
        # The next token sees at most the last window_tokens - 1; the whole window is a safe superset.
        return max(0, boundary - self.window_tokens), boundary

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "window_tokens": self.window_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SlidingWindow:
        return cls(window_tokens=data["window_tokens"])


@registered
@dataclass(frozen=True, kw_only=True)
class ChunkedLocal(TokenCache):
    """Keys and values of the tokens in the current attention chunk of ``chunk_tokens``."""

    kind: ClassVar[LayerKind] = LayerKind.CHUNKED_LOCAL
    chunk_tokens: int

    def __post_init__(self) -> None:
        positive_int("ChunkedLocal", "chunk_tokens", self.chunk_tokens)

    def tokens_held(self, context_tokens: int, block_size: int) -> int:
        return min(context_tokens, round_up(self.chunk_tokens, block_size))

    def tokens_needed(self, boundary: int) -> tuple[int, int]:
        # The next token attends within its own attention chunk only (none when one starts here).
        return boundary - boundary % self.chunk_tokens, boundary

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "chunk_tokens": self.chunk_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChunkedLocal:
        return cls(chunk_tokens=data["chunk_tokens"])


@registered
@dataclass(frozen=True, kw_only=True)
class MLAttention(EveryToken):
    """One compressed latent (plus its rope part) per token, shared by keys and values."""

    kind: ClassVar[LayerKind] = LayerKind.MLA

    def accepts_layout(self, layout: KVLayout) -> bool:
        return layout is KVLayout.MLA

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MLAttention:
        return cls()


@registered
@dataclass(frozen=True, kw_only=True)
class RecurrentState:
    """Fixed-size state per sequence (mamba conv + SSM state, linear-attention state).

    ``state_shapes`` lists the per-slot shape of each state tensor, e.g. the conv state
    ``(channels, conv_kernel - 1)`` and the SSM state ``(heads, head_dim, state_size)``.
    """

    kind: ClassVar[LayerKind] = LayerKind.RECURRENT
    token_indexed: ClassVar[bool] = False
    keeps_every_token: ClassVar[bool] = False
    state_shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.state_shapes, tuple) or not self.state_shapes:
            raise KVGroupsError(f"RecurrentState.state_shapes must be a non-empty tuple of shapes, "
                                f"got {self.state_shapes!r}")
        for shape in self.state_shapes:
            if not isinstance(shape, tuple) or not shape:
                raise KVGroupsError(f"RecurrentState.state_shapes entries must be non-empty tuples, got {shape!r}")
            for dim in shape:
                positive_int("RecurrentState", "state_shapes", dim)

    @property
    def state_elements(self) -> int:
        return sum(math.prod(shape) for shape in self.state_shapes)

    def accepts_layout(self, layout: KVLayout) -> bool:
        return layout is KVLayout.RECURRENT

    def tokens_held(self, context_tokens: int, block_size: int) -> int:
        return 0

    def bytes_per_token(self, slot_bytes: int) -> float:
        return 0

    def bytes_per_sequence(self, slot_bytes: int) -> int:
        return slot_bytes

    def tokens_needed(self, boundary: int) -> tuple[int, int]:
        return boundary, boundary

    def slot_range(self, start: int, end: int) -> tuple[int, int]:
        return 0, 1  # the one state, at the end

    def chunk_slots(self, num_tokens: int) -> int:
        return 1

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "state_shapes": [list(s) for s in self.state_shapes]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecurrentState:
        return cls(state_shapes=tuple(tuple(shape) for shape in data["state_shapes"]))


def spec_from_dict(data: Mapping[str, Any]) -> LayerCacheSpec:
    """Inverse of ``spec.to_dict()``."""
    if not isinstance(data, Mapping) or "kind" not in data:
        raise KVGroupsError(f"a layer spec must be a mapping with a 'kind', got {data!r}")
    try:
        kind = LayerKind(data["kind"])
    except ValueError:
        known = ", ".join(kind.value for kind in LayerKind)
        raise KVGroupsError(f"unknown layer kind {data['kind']!r}; expected one of {known}") from None
    try:
        return _FROM_DICT[kind](data)
    except KeyError as missing:
        raise KVGroupsError(f"layer spec of kind {kind.value} lacks field {missing}") from None


def default_spec(layout: KVLayout) -> LayerCacheSpec:
    """The spec a layer gets when none is given: MLA for MLA caches, else full attention."""
    if layout is KVLayout.MLA:
        return MLAttention()
    if layout is KVLayout.RECURRENT:
        raise KVGroupsError("a recurrent-state layer needs an explicit RecurrentState spec")
    return FullAttention()


# The kinds counted in rows or pages (they import this module, so they register once it is complete).
from kvgroups.core import row_specs  # noqa: E402, F401
