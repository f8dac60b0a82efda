"""Where the repository's parts are, for tests in any folder and the benchmarks."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Real configs that are not bundled (transcriptions, trimmed copies, a fragment): see configs/SOURCES.tsv.
CONFIGS = ROOT / "tests" / "configs"
