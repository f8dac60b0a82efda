"""What the check before a hit costs on a transformers version never verified (issue 39).

On the demo's two models (``examples/prefix_reuse_demo.py``: llama-like, and a qwen3-next-like
hybrid; 2048-token prompts sharing 1792 tokens, 256-token chunks, a memory store), request B's
time to first token (``PrefixCache.prefill``, a hit) three ways, interleaved in one process, each
round's order shuffled:

* verified: the installed transformers, which the sweep verified: no check;
* first hit, checked: transformers reporting a version never verified, nothing remembered: the
  first hit runs the check (one chunk computed, packed and restored, the suffix and four greedy
  steps continued both ways) before it loads;
* remembered: the same version with the pass on disk (another process's first hit): the
  fingerprint is computed and the record read.

Each round builds a fresh PrefixCache and store per variant; the table gives the medians of the
times and of the paired ratios against the verified hit, and what the check itself took.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.support.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))  # the demo's models: examples/ is no package

from prefix_reuse_demo import CHUNK, COMMON, MODELS, PROMPT, SHARED, build

from kvgroups.integrations.transformers import PrefixCache, check_records, restore_check
from kvgroups.store import MemoryStore

UNVERIFIED = "5.99.0"
VARIANTS = ("verified", "first hit, checked", "remembered")


def first_hit(model: Any, first: torch.Tensor, second: torch.Tensor, variant: str,
              installed: str) -> tuple[float, float]:
    """Request B's prefill seconds (a hit) and the check's own seconds (0 when none ran) under ``variant``."""
    transformers.__version__ = installed if variant == "verified" else UNVERIFIED
    restore_check._CHECKED.clear()  # a new process's memory
    try:
        with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
            cache.prefill(first)
            cache.flush()
            result = cache.prefill(second)
            if result.reused_tokens != SHARED:
                raise RuntimeError(f"{variant}: reused {result.reused_tokens} of {SHARED} tokens "
                                   f"({cache.restore_check})")
            check = cache.restore_check
            return result.seconds, check.seconds if check is not None else 0.0
    finally:
        transformers.__version__ = installed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    installed = transformers.__version__
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(3, COMMON["vocab_size"], (PROMPT,), generator=generator)
    second = torch.cat([first[:SHARED], torch.randint(3, COMMON["vocab_size"], (PROMPT - SHARED,),
                                                      generator=generator)])
    shuffle = random.Random(0)
    print(f"transformers {installed} (verified) against a version never verified, {UNVERIFIED}; "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}\n")
    print("| model | verified hit ms | first hit, checked ms | ratio | the check ms | remembered hit ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as directory:
        for label, (model_type, fields) in MODELS.items():
            model = build(model_type, fields)
            times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            checks: list[float] = []
            remembered = Path(directory) / f"{model_type}-remembered"  # its pass written by round 0's check
            for round_index in range(args.rounds + 1):  # round 0 warms up (and writes the pass) and is dropped
                order = list(VARIANTS)
                shuffle.shuffle(order)
                if round_index == 0:
                    order = [variant for variant in order if variant != "remembered"]
                measured = {}
                for variant in order:
                    records = remembered if variant == "remembered" or round_index == 0 else \
                        Path(directory) / f"{model_type}-{round_index}"
                    os.environ[check_records.DIRECTORY_VARIABLE] = str(records)  # where passes are remembered
                    measured[variant] = first_hit(model, first, second, variant, installed)
                if round_index:
                    for variant, (seconds, _) in measured.items():
                        times[variant].append(seconds)
                    checks.append(measured["first hit, checked"][1])
            verified = times["verified"]
            ratios = {variant: statistics.median(ours / base
                                                 for ours, base in zip(times[variant], verified, strict=True))
                      for variant in VARIANTS[1:]}
            print(f"| {label} | {statistics.median(verified) * 1e3:.0f} "
                  f"| {statistics.median(times['first hit, checked']) * 1e3:.0f} | {ratios['first hit, checked']:.2f}x "
                  f"| {statistics.median(checks) * 1e3:.0f} "
                  f"| {statistics.median(times['remembered']) * 1e3:.0f} | {ratios['remembered']:.2f}x |")


if __name__ == "__main__":
    main()
