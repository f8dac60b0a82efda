"""Short human-readable renderings shared by reprs, error messages and the CLI."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# An arithmetic run with a step above 1 is written out only when it is at least this long.
_MIN_STRIDED_RUN = 5


def compact_ranges(indices: Sequence[int]) -> str:
    """Layer indices compacted: ``[0, 1, 2, 3]`` -> ``"0-3"``, ``[3, 7, 11, 15]`` -> ``"3,7,11…15"``.

    Consecutive runs become ``a-b``; runs of a constant larger step become ``a,a+d,a+2d…last``;
    anything else is listed.
    """
    values = list(indices)
    if not values:
        return "[]"
    parts: list[str] = []
    position = 0
    while position < len(values):
        start = values[position]
        if position + 1 == len(values):
            parts.append(str(start))
            break
        step = values[position + 1] - start
        end = position + 1
        while end + 1 < len(values) and values[end + 1] - values[end] == step:
            end += 1
        run_length = end - position + 1
        if step == 1:
            parts.append(f"{start}-{values[end]}")
            position = end + 1
        elif step > 1 and run_length >= _MIN_STRIDED_RUN:
            parts.append(f"{start},{start + step},{start + 2 * step}…{values[end]}")
            position = end + 1
        else:
            parts.append(str(start))
            position += 1
    return ",".join(parts)


def describe_value(value: object) -> str:
    """``Tensor[2, 4, 16, 8, 64] bfloat16 on cpu`` for a tensor, the type name otherwise."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(item) for item in value)
        return f"{type(value).__name__}({inner})"
    return type(value).__name__
