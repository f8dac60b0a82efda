"""Torch dtypes by name: the one mapping used by serialization, the CLI and the fingerprint."""

from __future__ import annotations

import torch

from kvgroups.errors import KVGroupsError

# Only dtypes a KV cache or a recurrent state is stored in (int64: token ids a model keeps as context, positions
# an indexer ropes its keys by); a name outside this table is a typo.
_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int64": torch.int64,
}
_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _BY_NAME.items()}
# Short names engines accept on their command lines (vLLM's --kv-cache-dtype fp8).
ALIASES: dict[str, str] = {"fp8": "float8_e4m3fn"}
# What an engine offers a user to store a KV cache in (the CLI's choices, aliases added).
KV_CACHE_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float8_e4m3fn")
# What a recurrent state is kept in: its updates accumulate, so no 8-bit type.
STATE_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise KVGroupsError(
            f"dtype {dtype} is not a KV-cache dtype; expected one of {', '.join(_BY_NAME)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``, or an alias such as ``"fp8"``) -> ``torch.bfloat16``."""
    if not isinstance(name, str):
        raise TypeError(f"expected a dtype name (str), got {type(name).__name__} {name!r}")
    bare = name.removeprefix("torch.")
    try:
        return _BY_NAME[ALIASES.get(bare, bare)]
    except KeyError:
        raise KVGroupsError(
            f"unknown dtype name {name!r}; expected one of {', '.join(_BY_NAME)}"
        ) from None


def dtype_among(name: object, allowed: tuple[str, ...]) -> torch.dtype | None:
    """The dtype ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``, as configs write it) names when it is
    one of ``allowed``, else None: how a config's dtype field is checked against what a cache is kept in."""
    if not isinstance(name, str):
        return None
    bare = name.removeprefix("torch.")
    return _BY_NAME[bare] if bare in allowed else None
