"""Kinds whose slots are not tokens: compressed rows (one per window of tokens) and the pages of a window an
engine packs (moved whole, the last few a boundary needs).

DeepSeek-V4 keeps both: transformers holds its compressed entries as rows, vLLM every cache of it in pages
whose bytes its backend packs (``fp8_ds_mla``: a page's rows, then their scales), so that a token's bytes
cannot be told apart from its neighbours' and only whole pages are moved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvgroups.core.cache_specs import EveryToken, LayerKind, TokenCache, positive_int, registered
from kvgroups.core.layouts import KVLayout
from kvgroups.core.sizes import ceil_div, per_token


@registered
@dataclass(frozen=True, kw_only=True)
class CompressedRows(EveryToken):
    """One row per window of ``tokens_per_row`` tokens (DeepSeek-V4's compressed entries, its indexer's keys):
    row ``k`` sums up tokens ``[k * tokens_per_row, (k + 1) * tokens_per_row)`` once the last of them was
    computed (a window not complete yet lives in the compressor's boundary state). Where the engine packs
    a row into bytes (``fp8_ds_mla``) it is moved as bytes."""

    kind: ClassVar[LayerKind] = LayerKind.COMPRESSED
    tokens_per_row: int

    def __post_init__(self) -> None:
        positive_int("CompressedRows", "tokens_per_row", self.tokens_per_row)

    def accepts_layout(self, layout: KVLayout) -> bool:
        return layout is KVLayout.MLA

    def bytes_per_token(self, slot_bytes: int) -> float:
        return per_token(slot_bytes, self.tokens_per_row)

    def slot_range(self, start: int, end: int) -> tuple[int, int]:
        return start // self.tokens_per_row, end // self.tokens_per_row

    def chunk_slots(self, num_tokens: int) -> int:
        # A chunk that is no multiple of the rows' tokens completes one row more or less: room for the most.
        return ceil_div(num_tokens, self.tokens_per_row)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "tokens_per_row": self.tokens_per_row}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompressedRows:
        return cls(tokens_per_row=data["tokens_per_row"])


@registered
@dataclass(frozen=True, kw_only=True)
class WindowPages(TokenCache):
    """The pages of ``page_tokens`` tokens of a windowed cache an engine packs, of which a boundary needs the last
    ``pages`` (vLLM's DeepSeek-V4 window, 2 pages of 64 tokens; its compressor states, 2 of 4 or 16 of 8).

    A page is a slot, moved whole. A stored chunk holds the last ``pages`` pages before its end, as a state
    at the boundary would be held: the pages that restore a prefix ending there, all there while the step
    that completes the chunk runs (the engine frees a window's pages only before a later step).
    """

    kind: ClassVar[LayerKind] = LayerKind.WINDOW_PAGES
    page_tokens: int
    pages: int

    def __post_init__(self) -> None:
        positive_int("WindowPages", "page_tokens", self.page_tokens)
        positive_int("WindowPages", "pages", self.pages)

    def accepts_layout(self, layout: KVLayout) -> bool:
        return layout is KVLayout.MLA

    def tokens_held(self, context_tokens: int, block_size: int) -> int:
        return min(context_tokens, (self.pages + 1) * self.page_tokens)

    def tokens_needed(self, boundary: int) -> tuple[int, int]:
        return max(0, boundary - self.pages * self.page_tokens), boundary

    def bytes_per_token(self, slot_bytes: int) -> float:
        return per_token(slot_bytes, self.page_tokens)

    def slot_range(self, start: int, end: int) -> tuple[int, int]:
        # The pages a chunk ending at ``end`` holds, or a boundary at ``end`` needs: the last ones before it.
        last = end // self.page_tokens
        return max(0, last - self.pages), last

    def chunk_slots(self, num_tokens: int) -> int:
        return min(self.pages, ceil_div(num_tokens, self.page_tokens))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "page_tokens": self.page_tokens, "pages": self.pages}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WindowPages:
        return cls(page_tokens=data["page_tokens"], pages=data["pages"])


def window_pages(window_tokens: int, page_tokens: int) -> WindowPages:
    """The pages a window of ``window_tokens`` (its query's own row included) needs before a boundary, as vLLM's
    sliding-window manager keeps them: ``ceil((window_tokens - 1) / page_tokens)``."""
    return WindowPages(page_tokens=page_tokens, pages=max(1, ceil_div(window_tokens - 1, page_tokens)))
