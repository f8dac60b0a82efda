"""``KVLayerGroupsManager``: the groups of one model's layers, built from live caches, with O(1) lookups.

A lookup is one dict hit in C (see :class:`_Index`). The manager counts edits of its own list
and of the groups it indexes (each group tells the managers holding it) and empties its indexes
on each, so an edit to one manager's groups never costs another manager a reindex.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvgroups.errors import KVGroupsError, StaleGroupsError
from kvgroups.grouping import LayoutArg, plan_groups
from kvgroups.groups import KVLayerGroupInfo
from kvgroups.kinds import LayerCacheSpec
from kvgroups.tracked_lists import tracked

logger = logging.getLogger(__name__)

MANAGER_FORMAT = "kvgroups.manager/1"


class _Index(dict[Any, KVLayerGroupInfo]):
    """Layer index or name -> group; emptied by every edit, refilled by the first lookup that misses.

    A hit is one C-level dict lookup (the manager's lookup methods are this dict's
    ``__getitem__``); only a miss runs Python, to tell a stale index from a layer in no group.
    The index is refilled in place (a caller may hold the bound lookup), under the manager's
    lock, and a miss reads again after the lock: a lookup racing a refill waits for it rather
    than answer None for a layer that has a group.
    """

    __slots__ = ("manager",)

    def __init__(self, manager: KVLayerGroupsManager) -> None:
        super().__init__()
        self.manager = manager

    def __missing__(self, key: Any) -> KVLayerGroupInfo | None:
        manager = self.manager
        with manager.__dict__["_index_lock"]:
            if manager._indexed_version != manager._version:
                manager._reindex()
        return self.get(key)


@dataclass
class KVLayerGroupsManager:
    """The groups of one model's layers, with O(1) lookups by layer index and name.

    ``kv_layer_groups`` is a plain list to the caller: sorting it, assigning to it or mutating a
    group's layer lists is seen by the lookups.
    """

    kv_layer_groups: list[KVLayerGroupInfo] = field(default_factory=list)
    # Bumped by every edit of the list or of a group in it, which also empties the indexes; the
    # indexes remember the version they were built from.
    _version: int = field(default=0, init=False, repr=False, compare=False)
    _indexed_version: int = field(default=-1, init=False, repr=False, compare=False)
    # Invariants an owner (LMCacheMetadata) holds the groups to, checked whenever they are replaced.
    _checks: list[Callable[[Sequence[KVLayerGroupInfo]], None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._bind_indexes()

    def _bind_indexes(self) -> None:
        by_index, by_name = _Index(self), _Index(self)
        object.__setattr__(self, "_index_lock", threading.Lock())
        object.__setattr__(self, "_by_index", by_index)
        object.__setattr__(self, "_by_name", by_name)
        # Lookups are the indexes' own __getitem__: no Python frame on a hit (see _Index).
        object.__setattr__(self, "get_group_by_layer_idx", by_index.__getitem__)
        object.__setattr__(self, "get_group_by_layer_name", by_name.__getitem__)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "kv_layer_groups":
            if not isinstance(value, list):
                raise TypeError(f"kv_layer_groups must be a list, got {type(value).__name__}")
            for check in getattr(self, "_checks", ()):
                check(value)
            value = tracked(value, self)
            object.__setattr__(self, name, value)
            self._changed()
            return
        object.__setattr__(self, name, value)

    def _changed(self) -> None:
        object.__setattr__(self, "_version", getattr(self, "_version", 0) + 1)
        for index in (getattr(self, "_by_index", None), getattr(self, "_by_name", None)):
            if index:
                index.clear()

    def add_check(self, check: Callable[[Sequence[KVLayerGroupInfo]], None]) -> None:
        """Run ``check`` on the current groups now and on every list of groups that replaces them."""
        check(self.kv_layer_groups)
        self._checks.append(check)

    def __getstate__(self) -> dict[str, Any]:
        # A copy's groups are copies that know no manager: its first lookup reindexes and registers.
        return {**{item.name: getattr(self, item.name) for item in fields(self)}, "_indexed_version": -1}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._bind_indexes()

    @property
    def num_groups(self) -> int:
        return len(self.kv_layer_groups)

    def _reindex(self) -> None:
        version = self._version  # read before rebuilding: an edit meanwhile leaves the index stale
        by_index: _Index = self.__dict__["_by_index"]
        by_name: _Index = self.__dict__["_by_name"]
        by_index.clear()
        by_name.clear()
        # First group wins where a caller's edits left a layer in two, as a linear scan would.
        for group in self.kv_layer_groups:
            group._held_by(self)
            for index in group.layer_indices:
                by_index.setdefault(index, group)
            for name in group.layer_names:
                by_name.setdefault(name, group)
        if self._version != version:
            by_index.clear()
            by_name.clear()
            return
        self._indexed_version = version

    def get_group_by_layer_idx(self, layer_idx: int) -> KVLayerGroupInfo | None:
        """The group holding layer ``layer_idx``, or None (an instance's own index answers; see _Index)."""
        return self.__dict__["_by_index"][layer_idx]  # type: ignore[no-any-return]

    def get_group_by_layer_name(self, layer_name: str) -> KVLayerGroupInfo | None:
        """The group holding layer ``layer_name``, or None."""
        return self.__dict__["_by_name"][layer_name]  # type: ignore[no-any-return]

    def get_layer_shape(self, layer_idx: int) -> torch.Size | None:
        group = self.get_group_by_layer_idx(layer_idx)
        return group.shape if group is not None else None

    def get_layer_dtype(self, layer_idx: int) -> torch.dtype | None:
        group = self.get_group_by_layer_idx(layer_idx)
        return group.dtype if group is not None else None

    def build_kv_layer_groups(
        self,
        kv_caches: Mapping[str, Any],
        layer_specs: Mapping[str, LayerCacheSpec] | None = None,
        *,
        layout: LayoutArg = None,
        rebuild: bool = False,
    ) -> None:
        """Group the layers of ``kv_caches`` (layer name -> cache) by :class:`GroupKey`.

        A layer's index is its position in ``kv_caches``; groups are ordered by their first
        layer and keep the dict's order inside. Each cache is a tensor in one of the
        :class:`~kvgroups.layouts.KVLayout` layouts, a ``(k, v)`` pair, or for a recurrent layer
        (whose ``layer_specs`` entry is a :class:`~kvgroups.kinds.RecurrentState`) a tensor or
        tuple of state tensors ``[num_state_slots, *state_shape]``. ``layout`` fixes the layout
        of every layer, or of the named ones; otherwise it is detected. Tensor data is never read.

        Building again with caches that group the same way is a no-op; caches that group
        differently raise :class:`~kvgroups.errors.StaleGroupsError` unless ``rebuild``.
        """
        planned = plan_groups(kv_caches, layer_specs, layout)
        groups = [KVLayerGroupInfo._trusted(names, indices, key) for key, names, indices in planned]
        if self.kv_layer_groups and not rebuild:
            if groups == list(self.kv_layer_groups):
                return
            raise StaleGroupsError(
                f"groups are built already ({self.num_groups} groups) and these caches group "
                f"differently ({len(groups)} groups: {groups}); pass rebuild=True to replace them"
            )
        self.kv_layer_groups = groups
        logger.info("KV layer groups: %s", groups)

    # --- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": MANAGER_FORMAT, "groups": [g.to_dict() for g in self.kv_layer_groups]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayerGroupsManager:
        if not isinstance(data, Mapping) or data.get("format") != MANAGER_FORMAT:
            raise KVGroupsError(
                f"not a serialized KVLayerGroupsManager: expected format {MANAGER_FORMAT!r}"
            )
        return cls([KVLayerGroupInfo.from_dict(group) for group in data["groups"]])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVLayerGroupsManager:
        return cls.from_dict(json.loads(text))
