"""How many scattered rows the CPU kernel moves in lockstep, measured on the caches once per process.

A gather of scattered token rows is bound by the misses (and page walks) in flight, and how many
help depends on the CPU: on this project's AMD EPYC VM sixteen rows, a cache line of each in turn,
moved arbitrary slots 1.2-1.36x as fast as four; elsewhere four may win. So the first transfer of
each kind of row (row and chunk row bytes, layers and planes, threads) gathers a few MiB of
scattered rows from its own caches into a scratch buffer both ways, interleaved, a few times (a few
milliseconds, read-only on the caches), and keeps the faster for the process; ``KVTransfer``'s
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

ROUNDS = 3  # timed gathers per width, interleaved; the fastest of each counts
SAMPLE_BYTES = 4 * MIB  # about as much as a chunk's gather moves, so that it runs as a chunk's does
_Kind = tuple[int, int, int, int]
_chosen: dict[_Kind, tuple[bool, float, float]] = {}  # kind -> (wide, seconds wide, seconds four)
_lock = threading.Lock()


def choose(copier: NumbaTokenCopier, num_slots: int) -> str:
    """Set ``copier.wide`` to the faster width for its rows (measured once per kind); what was chosen, in words."""
    if not copier.scattered_rows or num_slots < 2 * WIDE_ROWS:
        return "runs of whole rows"
    table = copier.tables[0]
    planes = sum(len(bases) for bases in copier.bases)
    threads = copier.num_threads or torch.get_num_threads()
    kind = (table.row_bytes, table.chunk_row_bytes, planes, threads)
    with _lock:
        if kind not in _chosen:
            _chosen[kind] = _measure(copier, num_slots)
            wide, seconds_wide, seconds_four = _chosen[kind]
            logger.debug("numba kernel: scattered rows of %d bytes (%d planes x layers, %d threads) move %d at a "
                         "time: %.3f ms for %d, %.3f ms for 4", table.row_bytes, planes, threads,
                         WIDE_ROWS if wide else 4, seconds_wide * 1e3, WIDE_ROWS, seconds_four * 1e3)
        wide, seconds_wide, seconds_four = _chosen[kind]
    copier.wide = wide
    return (f"scattered rows {WIDE_ROWS if wide else 4} at a time (measured: {seconds_wide * 1e3:.2f} ms for "
            f"{WIDE_ROWS}, {seconds_four * 1e3:.2f} ms for 4)")


def _measure(copier: NumbaTokenCopier, num_slots: int) -> tuple[bool, float, float]:
    """The fastest of :data:`ROUNDS` gathers at each width, interleaved, each of slots of its own (so that
    none finds its rows in the CPU's caches)."""
    table = copier.tables[0]
    planes = sum(len(bases) for bases in copier.bases)
    per_token = planes * table.chunk_row_bytes
    runs = 2 * (ROUNDS + 1)
    tokens = max(WIDE_ROWS, min(num_slots // runs, math.ceil(SAMPLE_BYTES / per_token)) // WIDE_ROWS * WIDE_ROWS)
    every = np.random.default_rng(0).permutation(num_slots).astype(np.int64)
    # (Small caches repeat slots across runs, never within one: a pack may read a slot twice anyway.)
    samples = [every[np.arange(run * tokens, (run + 1) * tokens) % num_slots] for run in range(runs)]
    # Where the rows go: a chunk of these tokens (64-byte aligned, as the chunks the data path hands out are).
    scratch = torch.empty(tokens * per_token + table.chunk_column + 64, dtype=torch.uint8)
    chunk_at = scratch.data_ptr() + (-scratch.data_ptr() % 64)
    best = {True: math.inf, False: math.inf}
    for round_ in range(ROUNDS + 1):  # the first round is a warm-up
        for wide in ((True, False) if round_ % 2 else (False, True)):
            slots = samples[2 * round_ + wide]
            begin = time.perf_counter()
            for index, each in enumerate(copier.tables):
                copier.launch(index, slots, chunk_at + each.chunk_offset(tokens), tokens * per_token, scatter=False,
                              wide=wide)
            if round_:
                best[wide] = min(best[wide], time.perf_counter() - begin)
    return best[True] <= best[False], best[True], best[False]
