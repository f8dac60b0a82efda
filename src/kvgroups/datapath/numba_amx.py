"""The CPU kernel for vLLM's amx pages (layout ``VLLM_CPU_AMX``): token rows into and out of AMX tiles.

vLLM's amx attention kernels keep each (block, head) page as AMX B tiles (the order is spelled
out in :mod:`kvgroups.core.cpu_pages`): a token's keys are pairs of elements 64 bytes apart, its
values single elements 4 bytes apart, interleaved with its neighbour token's. No token has a row,
so the generic kernel's runs do not apply; this one walks each token's pairs and elements from
an :class:`~kvgroups.datapath.address_tables.AmxTable`, one (layer, token) per iteration, over
both threads for large calls. Importing this module imports numba.
"""

from __future__ import annotations

from typing import Any

import numba
import torch
from numba import njit, prange

from kvgroups.core.cpu_pages import AMX_KEY_TOKENS_PER_GROUP, AMX_VALUE_ELEMENTS_PER_GROUP
from kvgroups.datapath import numba_copy
from kvgroups.datapath.address_tables import AmxTable, check_still_bound
from kvgroups.datapath.numba_copy import run_parallel
from kvgroups.datapath.numba_intrinsics import move_element
from kvgroups.datapath.slots import CallSlots

_TILE_ROW_BYTES = 64  # an AMX tile row: 16 pairs of 2-byte elements
_KEY_GROUP = AMX_KEY_TOKENS_PER_GROUP
_VALUE_GROUP = AMX_VALUE_ELEMENTS_PER_GROUP


@njit(nogil=True, cache=True, inline="always")
def _copy_token(item: int, bases: Any, chunk: int, num_tokens: int, num_layers: int, slots: Any, block_size: int,
                block_stride: int, head_stride: int, num_heads: int, head_size: int, scatter: bool) -> None:
    """Token ``item % num_tokens`` of layer ``item // num_tokens``: its keys and its values, every head."""
    layer = item // num_tokens
    token = item - layer * num_tokens
    block = slots[token] // block_size
    offset = slots[token] - block * block_size
    row_bytes = num_heads * head_size * 2
    key_row = chunk + (layer * num_tokens + token) * row_bytes
    value_row = chunk + ((num_layers + layer) * num_tokens + token) * row_bytes
    pages = bases[layer] + block * block_stride
    # Keys: groups of 16 tokens; in a group, pair p of every token (4 bytes), then pair p + 1.
    key_at = (offset // _KEY_GROUP) * _KEY_GROUP * head_size * 2 + (offset % _KEY_GROUP) * 4
    # Values after the keys: groups of 16 head elements; in a group, tokens in pairs, element by element.
    value_at = block_size * head_size * 2 + (offset // 2) * _TILE_ROW_BYTES + (offset % 2) * 2
    value_group_bytes = _VALUE_GROUP * block_size * 2
    for head in range(num_heads):
        page = pages + head * head_stride
        keys, key_columns = page + key_at, key_row + head * head_size * 2
        values, value_columns = page + value_at, value_row + head * head_size * 2
        if scatter:
            for pair in range(head_size // 2):
                move_element(keys + pair * _TILE_ROW_BYTES, key_columns + pair * 4, 4)
            for group in range(head_size // _VALUE_GROUP):
                tile, columns = values + group * value_group_bytes, value_columns + group * _VALUE_GROUP * 2
                for element in range(_VALUE_GROUP):
                    move_element(tile + element * 4, columns + element * 2, 2)
        else:
            for pair in range(head_size // 2):
                move_element(key_columns + pair * 4, keys + pair * _TILE_ROW_BYTES, 4)
            for group in range(head_size // _VALUE_GROUP):
                tile, columns = values + group * value_group_bytes, value_columns + group * _VALUE_GROUP * 2
                for element in range(_VALUE_GROUP):
                    move_element(columns + element * 2, tile + element * 4, 2)


@njit(nogil=True, cache=True)
def _copy_serial(bases: Any, chunk: int, num_tokens: int, slots: Any, block_size: int, block_stride: int,
                 head_stride: int, num_heads: int, head_size: int, scatter: bool) -> None:
    for item in range(bases.shape[0] * num_tokens):
        _copy_token(item, bases, chunk, num_tokens, bases.shape[0], slots, block_size, block_stride, head_stride,
                    num_heads, head_size, scatter)


@njit(nogil=True, cache=True, parallel=True)
def _copy_parallel(bases: Any, chunk: int, num_tokens: int, slots: Any, block_size: int, block_stride: int,
                   head_stride: int, num_heads: int, head_size: int, scatter: bool) -> None:
    for item in prange(bases.shape[0] * num_tokens):
        _copy_token(item, bases, chunk, num_tokens, bases.shape[0], slots, block_size, block_stride, head_stride,
                    num_heads, head_size, scatter)


class NumbaAmxCopier:
    """The copies of one ``VLLM_CPU_AMX`` group, every layer and both planes in one kernel call."""

    def __init__(self, table: AmxTable, num_threads: int | None) -> None:
        self.table = table
        self.num_threads = num_threads
        self.bases = table.bases.numpy()

    def copy(self, chunk: torch.Tensor, call: CallSlots, scatter: bool) -> None:
        if call.slot_values is None or not call.num_tokens:
            return
        check_still_bound(self.table)
        table = self.table
        arguments = (self.bases, chunk.data_ptr(), call.num_tokens, call.slot_values, table.block_size,
                     table.block_stride, table.head_stride, table.num_heads, table.head_size, scatter)
        threads = self.num_threads or torch.get_num_threads()
        if threads > 1 and chunk.numel() * chunk.element_size() >= numba_copy.PARALLEL_MIN_BYTES:
            run_parallel(_copy_parallel, arguments, threads)
        else:
            _copy_serial(*arguments)


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels now: one page of 16 tokens out and back."""
    page = torch.arange(2 * 16 * 16, dtype=torch.int16).view(1, 1, 16, 32)
    expected = page.clone()
    chunk = torch.empty(2, 1, 16, 16, dtype=torch.int16)
    bases = torch.tensor([page.data_ptr()], dtype=torch.int64).numpy()
    slots = torch.arange(16, dtype=torch.int64).numpy()
    for kernel in (_copy_serial, _copy_parallel):
        for scatter in (False, True):
            run_parallel(kernel, (bases, chunk.data_ptr(), 16, slots, 16, page.stride(0) * 2, page.stride(1) * 2, 1, 16,
                                  scatter), numba.config.NUMBA_NUM_THREADS)
    if not torch.equal(page, expected) or chunk[0, 0, 1, 0] != page.flatten()[2]:
        raise RuntimeError("the numba amx kernel failed its warm-up copy")
