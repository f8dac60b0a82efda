"""Argument types of the ``kvgroups`` command: strings become ints, GiB, layouts and dtypes here."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from kvgroups.core.dtypes import ALIASES, KV_CACHE_DTYPES, STATE_DTYPES, dtype_from_name
from kvgroups.core.layouts import KVLayout

# Layout names as the command line spells them; "hnd" is the short name of FlashInfer's HND layout.
LAYOUTS: dict[str, KVLayout] = {
    **{layout.value.replace("_", "-"): layout for layout in KVLayout if layout.holds_kv},
    "hnd": KVLayout.FLASHINFER_HND,
}


def _dtype_choices(names: Sequence[str]) -> dict[str, torch.dtype | None]:
    """``auto`` (the config's dtype), each name, and the aliases of those names."""
    choices: dict[str, torch.dtype | None] = {"auto": None}
    choices.update({name: dtype_from_name(name) for name in names})
    choices.update({alias: dtype_from_name(alias) for alias, name in ALIASES.items() if name in names})
    return choices


KV_DTYPES = _dtype_choices(KV_CACHE_DTYPES)
STATE_DTYPE_CHOICES = _dtype_choices(STATE_DTYPES)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for ints >= ``minimum``."""
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of GiB, got {text!r}")
    return value


def plot_path(text: str) -> str:
    if not text.lower().endswith((".png", ".svg")):
        raise argparse.ArgumentTypeError(f"expected a .png or .svg file name, got {text!r}")
    return text
