"""Whole-unit arithmetic and byte sizes: rounding to blocks, and sizes written with a unit suffix."""

from __future__ import annotations

import re

from kvgroups.errors import KVGroupsError

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

_UNITS = {"": 1, "B": 1, "KIB": KIB, "MIB": MIB, "GIB": GIB, "TIB": TIB, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "TB": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def ceil_div(numerator: int, denominator: int) -> int:
    """``numerator / denominator`` rounded up, in integers (blocks a token count needs)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a whole number of ``multiple`` (tokens in whole blocks)."""
    return ceil_div(value, multiple) * multiple


def parse_size(text: str, what: str) -> int:
    """Bytes from ``"8GiB"``, ``"512 MiB"``, ``"1.5GB"`` or a plain byte count; ``what`` names the field."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = _UNITS.get(match.group(2).upper()) if match else None
    if match is None or unit is None:
        raise KVGroupsError(
            f"{what}={text!r} is not a size; expected a byte count or a number with a unit "
            f"(KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 8GiB"
        )
    return int(float(match.group(1)) * unit)


def per_token(total_bytes: int, tokens: int) -> float:
    """``total_bytes`` over ``tokens`` (a slot's or a page's bytes over the tokens it serves): an int where they
    divide, else the float quotient (exact for the power-of-two blocks engines use)."""
    whole, remainder = divmod(total_bytes, tokens)
    return whole if remainder == 0 else total_bytes / tokens
