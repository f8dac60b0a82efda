"""Lists that tell their owner of every in-place change, so the owner's lookup index knows it is stale.

The seed API hands groups and layer names out as plain lists that a caller may sort, append to
or assign into; the owner (a group, a manager) keeps an O(1) index over them. Each owner counts
its own edits; nothing is shared across owners or processes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")


class Owner(Protocol):
    """Whoever indexes a tracked list."""

    def _changed(self) -> None: ...


class TrackedList(list[_T]):
    """A list that calls ``owner._changed()`` after every in-place change.

    Copies and pickles keep their owner (a copy of the owner, when the owner is copied with it).
    """

    def __init__(self, items: Iterable[_T], owner: Owner) -> None:
        super().__init__(items)
        self.owner = owner

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrackedList, (list(self), self.owner))


def _notifying(name: str) -> Any:
    method = getattr(list, name)

    def changed(self: TrackedList[Any], *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        self.owner._changed()
        return result

    changed.__name__ = name
    return changed


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "remove",
              "pop", "clear", "sort", "reverse"):
    setattr(TrackedList, _name, _notifying(_name))


def tracked(items: Iterable[_T], owner: Owner) -> TrackedList[_T]:
    """``items`` as a list tracked by ``owner`` (itself, when it is one already)."""
    if isinstance(items, TrackedList) and items.owner is owner:
        return items
    return TrackedList(items, owner)
