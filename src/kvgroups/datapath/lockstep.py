"""How the CPU kernel moves scattered rows, measured on the caches once per process: how many in lockstep,
and how far ahead a gather asks for the rows it copies next.

A gather of scattered token rows is bound by the misses (and page walks) in flight, and what keeps
most in flight depends on the CPU: on this project's AMD EPYC VM sixteen rows, a cache line of each
in turn, moved arbitrary slots 1.2-1.36x as fast as four on one day and slower on another, and
asking for the first line of the rows a few rows on before copying the current ones took a 256-token
gather from 0.75 to 0.78 of ``copy_`` with four rows (8 ahead) and from 0.82 to 0.85 with sixteen
(16 ahead), in one process; the ways' order changes between runs. So the first transfer of each
kind of row (row and chunk row bytes, layers and planes, threads) gathers a few MiB of scattered
rows from its own caches into a scratch buffer in each way, interleaved, a few times (a few
milliseconds, read-only on the caches), and keeps the fastest for the process; ``KVTransfer``'s
``lockstep`` and the debug log say which was chosen and what was measured.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np
import torch

from kvgroups.core.sizes import MIB
from kvgroups.datapath.numba_copy import NumbaTokenCopier
from kvgroups.datapath.numba_intrinsics import WIDE_ROWS

logger = logging.getLogger(__name__)

ROUNDS = 3  # timed gathers per way, interleaved; the fastest of each counts
SAMPLE_BYTES = 4 * MIB  # about as much as a chunk's gather moves, so that it runs as a chunk's does
# The ways measured: (WIDE_ROWS in lockstep, else four; rows ahead a gather asks for, 0: none).
WAYS: tuple[tuple[bool, int], ...] = ((True, 0), (False, 0), (True, WIDE_ROWS), (False, 8))
_Kind = tuple[int, int, int, int]
_chosen: dict[_Kind, tuple[tuple[bool, int], dict[tuple[bool, int], float]]] = {}  # kind -> (way, seconds per way)
_lock = threading.Lock()


def _words(way: tuple[bool, int]) -> str:
    wide, ahead = way
    return f"{WIDE_ROWS if wide else 4} at a time" + (f", {ahead} rows ahead asked for" if ahead else "")


def choose(copier: NumbaTokenCopier, num_slots: int) -> str:
    """Set ``copier.wide`` and ``copier.ahead`` to the fastest way for its rows (measured once per kind); what
    was chosen, in words."""
    if not copier.scattered_rows or num_slots < 2 * WIDE_ROWS:
        return "runs of whole rows"
    table = copier.tables[0]
    planes = sum(len(bases) for bases in copier.bases)
    threads = copier.num_threads or torch.get_num_threads()
    kind = (table.row_bytes, table.chunk_row_bytes, planes, threads)
    with _lock:
        if kind not in _chosen:
            seconds = _measure(copier, num_slots)
            _chosen[kind] = min(seconds, key=seconds.__getitem__), seconds
            logger.debug("numba kernel: scattered rows of %d bytes (%d planes x layers, %d threads) move %s: %s",
                         table.row_bytes, planes, threads, _words(_chosen[kind][0]), _measured(seconds))
        way, seconds = _chosen[kind]
    copier.wide, copier.ahead = way
    return f"scattered rows {_words(way)} (measured: {_measured(seconds)})"


def _measured(seconds: dict[tuple[bool, int], float]) -> str:
    return ", ".join(f"{value * 1e3:.2f} ms for {_words(way)}" for way, value in seconds.items())


def _measure(copier: NumbaTokenCopier, num_slots: int) -> dict[tuple[bool, int], float]:
    """The fastest of :data:`ROUNDS` gathers in each of :data:`WAYS`, interleaved (the order rotating), each
    of slots of its own (so that none finds its rows in the CPU's caches)."""
    table = copier.tables[0]
    planes = sum(len(bases) for bases in copier.bases)
    per_token = planes * table.chunk_row_bytes
    runs = len(WAYS) * (ROUNDS + 1)
    tokens = max(WIDE_ROWS, min(num_slots // runs, math.ceil(SAMPLE_BYTES / per_token)) // WIDE_ROWS * WIDE_ROWS)
    every = np.random.default_rng(0).permutation(num_slots).astype(np.int64)
    # (Small caches repeat slots across runs, never within one: a pack may read a slot twice anyway.)
    samples = [every[np.arange(run * tokens, (run + 1) * tokens) % num_slots] for run in range(runs)]
    # Where the rows go: a chunk of these tokens (64-byte aligned, as the chunks the data path hands out are).
    scratch = torch.empty(tokens * per_token + table.chunk_column + 64, dtype=torch.uint8)
    chunk_at = scratch.data_ptr() + (-scratch.data_ptr() % 64)
    best = dict.fromkeys(WAYS, math.inf)
    for round_ in range(ROUNDS + 1):  # the first round is a warm-up
        for turn in range(len(WAYS)):
            way = WAYS[(turn + round_) % len(WAYS)]
            slots = samples[len(WAYS) * round_ + turn]
            begin = time.perf_counter()
            for index, each in enumerate(copier.tables):
                copier.launch(index, slots, chunk_at + each.chunk_offset(tokens), tokens * per_token, scatter=False,
                              wide=way[0], ahead=way[1])
            if round_:
                best[way] = min(best[way], time.perf_counter() - begin)
    return best
