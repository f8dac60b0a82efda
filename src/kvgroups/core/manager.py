"""``KVLayerGroupsManager``: the groups of one model's layers, built from live caches, with O(1) lookups.

A lookup is one dict lookup in C, no Python frame. The manager's indexes are brought up to date
by every edit of its own list and of the groups it indexes (each group tells the managers
holding it), so an edit to one manager's groups never costs another manager a reindex.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvgroups.core.cache_specs import LayerCacheSpec
from kvgroups.core.grouping import LayoutArg, ValueHeadSizeArg, plan_groups
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.tracked_lists import tracked
from kvgroups.errors import KVGroupsError, StaleGroupsError

logger = logging.getLogger(__name__)

MANAGER_FORMAT = "kvgroups.manager/1"


def _swap_in(index: dict[Any, KVLayerGroupInfo], fresh: dict[Any, KVLayerGroupInfo]) -> None:
    """Make ``index`` equal ``fresh`` in place, key by key: a concurrent reader sees each layer's
    old or new group, never a missing entry for a layer that has a group before and after."""
    index.update(fresh)
    if len(index) != len(fresh):  # equal sizes after the update mean equal key sets
        for key in [key for key in index if key not in fresh]:
            del index[key]


@dataclass
class KVLayerGroupsManager:
    """The groups of one model's layers, with O(1) lookups by layer index and name.

    ``kv_layer_groups`` is a plain list to the caller: sorting it, assigning to it or mutating a
    group's layer lists is seen by the lookups.
    """

    kv_layer_groups: list[KVLayerGroupInfo] = field(default_factory=list)
    # Invariants an owner (LMCacheMetadata) holds the groups to, checked whenever they are replaced.
    _checks: list[Callable[[Sequence[KVLayerGroupInfo]], None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self._bind_indexes()

    def _bind_indexes(self) -> None:
        by_index: dict[int, KVLayerGroupInfo] = {}
        by_name: dict[str, KVLayerGroupInfo] = {}
        object.__setattr__(self, "_by_index", by_index)
        object.__setattr__(self, "_by_name", by_name)
        # The lookups are the index dicts' own get (see get_group_by_layer_idx). The indexes are
        # therefore kept current on every edit, and updated in place, since a caller may hold the
        # bound lookup.
        object.__setattr__(self, "get_group_by_layer_idx", by_index.get)
        object.__setattr__(self, "get_group_by_layer_name", by_name.get)
        self._reindex()

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
        """Told by the tracked list and by every group it holds after each edit."""
        if "_by_index" in self.__dict__:  # not before __post_init__ has bound the indexes
            self._reindex()

    def add_check(self, check: Callable[[Sequence[KVLayerGroupInfo]], None]) -> None:
        """Run ``check`` on the current groups now and on every list of groups that replaces them."""
        check(self.kv_layer_groups)
        self._checks.append(check)

    def __getstate__(self) -> dict[str, Any]:
        # A copy's groups are copies that know no manager; unpickling indexes them afresh.
        return {item.name: getattr(self, item.name) for item in fields(self)}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._bind_indexes()

    @property
    def num_groups(self) -> int:
        return len(self.kv_layer_groups)

    def _reindex(self) -> None:
        by_index: dict[int, KVLayerGroupInfo] = {}
        by_name: dict[str, KVLayerGroupInfo] = {}
        # First group wins where a caller's edits left a layer in two, as a linear scan would:
        # later groups go in first and are overwritten (fromkeys/update keep the loop in C).
        for group in reversed(self.kv_layer_groups):
            group._held_by(self)
            by_index.update(dict.fromkeys(group.layer_indices, group))
            by_name.update(dict.fromkeys(group.layer_names, group))
        _swap_in(self.__dict__["_by_index"], by_index)
        _swap_in(self.__dict__["_by_name"], by_name)

    # Why these two are written here and never run on an instance: every instance binds its index
    # dicts' own ``get`` under these names (``_bind_indexes``), so a lookup runs no Python frame. The
    # bodies give the API its signatures and docs, and answer the same when called on the class
    # (``KVLayerGroupsManager.get_group_by_layer_idx(manager, 3)``).
    def get_group_by_layer_idx(self, layer_idx: int) -> KVLayerGroupInfo | None:
        """The group holding layer ``layer_idx``, or None; O(1)."""
        return self.__dict__["_by_index"].get(layer_idx)  # type: ignore[no-any-return]

    def get_group_by_layer_name(self, layer_name: str) -> KVLayerGroupInfo | None:
        """The group holding layer ``layer_name``, or None; O(1)."""
        return self.__dict__["_by_name"].get(layer_name)  # type: ignore[no-any-return]

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
        value_head_size: ValueHeadSizeArg = None,
        rebuild: bool = False,
    ) -> None:
        """Group the layers of ``kv_caches`` (layer name -> cache) by :class:`GroupKey`.

        A layer's index is its position in ``kv_caches``; groups are ordered by their first
        layer and keep the dict's order inside. Each cache is a tensor in one of the
        :class:`~kvgroups.core.layouts.KVLayout` layouts, a ``(k, v)`` pair, or for a recurrent layer
        (whose ``layer_specs`` entry is a :class:`~kvgroups.core.cache_specs.RecurrentState`) a tensor or
        tuple of state tensors ``[num_state_slots, *state_shape]``. ``layout`` fixes the layout
        of every layer, or of the named ones; otherwise it is detected. ``value_head_size`` (for
        every layer, or the named ones) is the values' head size of vLLM pages whose values differ
        from their keys (a ``(k, v)`` pair shows it in its V tensor). Tensor data is never read.

        Building again with caches that group the same way is a no-op; caches that group
        differently raise :class:`~kvgroups.errors.StaleGroupsError` unless ``rebuild``.
        """
        planned = plan_groups(kv_caches, layer_specs, layout, value_head_size)
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
