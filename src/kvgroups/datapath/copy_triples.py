"""A launch's copies as (source, destination, bytes) triples, for a batched copy call rather than a kernel.

Where a token's row is one contiguous piece in the cache and in the chunk (NHD pages with K and V in
planes of their own, MLA latents), the copies of a group's queued runs are runs of bytes: one triple
per (plane and layer, run) where a run's tokens follow each other in the cache block and in the
chunk (a block-aligned run of a FlashAttention page: ``block_size`` rows of all heads, 32 KiB for 16
tokens of 8 heads of 128 bf16), one per token otherwise. The copy engines move such runs at
``copy_`` speed through one batched call (CUDA's ``cuMemcpyBatchAsync``, as vLLM's offloading worker
issues them); :func:`apply_on_host` applies triples with ``memmove`` on host memory, which is how the
tests hold them to the torch path. Triples are built by NumPy from the descriptor runs and the bound
tables, as the kernels' addresses are.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvgroups.datapath.address_tables import TokenTable
from kvgroups.datapath.descriptors import CHUNK_ADDRESS, CHUNK_ROWS, FIRST_ROW, FIRST_SLOT, SLOT_COUNT


def supports(tables: tuple[TokenTable, ...]) -> bool:
    """Whether every row of these tables is one contiguous piece in the cache and in a chunk."""
    return all(table.rows_contiguous and table.chunk_rows_contiguous for table in tables)


def token_triples(tables: tuple[TokenTable, ...], block_size: int, runs: np.ndarray,
                  scatter: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source and destination addresses and byte counts of the copies of ``runs`` (descriptor runs, as
    :class:`~kvgroups.datapath.run_queue.RunQueue` writes them) between the tables' caches and chunks;
    ``scatter``: chunk to cache."""
    if not supports(tables):
        raise ValueError("copy triples need rows that are one contiguous piece in the cache and in the chunk; "
                         "these tables spread a row (HND heads, transposed pages): use the kernel")
    sources, targets, sizes = [], [], []
    first = runs[:, FIRST_SLOT]
    count = runs[:, SLOT_COUNT]
    blocks, offsets = np.divmod(first, block_size)
    for table in tables:
        # A run moves as one piece where its rows follow each other in the cache block too.
        whole = table.offset_stride == table.row_bytes
        for index, base in enumerate(table.bases.tolist()):
            plane_layer = table.first_plane * table.num_layers + index
            cache = base + blocks * table.block_stride + offsets * table.offset_stride
            chunk = (runs[:, CHUNK_ADDRESS] + (plane_layer * runs[:, CHUNK_ROWS] + runs[:, FIRST_ROW])
                     * table.chunk_row_bytes + table.chunk_column)
            if whole:
                pieces = (cache, chunk, count * table.row_bytes)
            else:  # one triple per token of every run
                token = np.arange(int(count.max()))
                inside = token[None, :] < count[:, None]
                pieces = ((cache[:, None] + token * table.offset_stride)[inside],
                          (chunk[:, None] + token * table.chunk_row_bytes)[inside],
                          np.full(int(inside.sum()), table.row_bytes, dtype=np.int64))
            sources.append(pieces[1] if scatter else pieces[0])
            targets.append(pieces[0] if scatter else pieces[1])
            sizes.append(pieces[2])
    return np.concatenate(sources), np.concatenate(targets), np.concatenate(sizes)


def apply_on_host(sources: np.ndarray, targets: np.ndarray, sizes: np.ndarray) -> None:
    """Apply triples to host memory, one ``memmove`` each (the stand-in for the copy engines' batched call)."""
    for source, target, size in zip(sources.tolist(), targets.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(target, source, size)
