"""The one test of "an int, and not a bool" that every argument check uses.

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds; a count, an index
or a size given as ``True`` is a mistake everywhere kvgroups takes one.
"""

from __future__ import annotations

from typing import TypeGuard

from kvgroups.errors import KVGroupsError


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_int_at_least(value: object, minimum: int) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool) of at least ``minimum``."""
    return is_int(value) and value >= minimum


def int_at_least(what: str, value: object, minimum: int) -> int:
    """``value`` when it is an int >= ``minimum``; else ``KVGroupsError`` naming ``what``."""
    if not is_int_at_least(value, minimum):
        raise KVGroupsError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value
