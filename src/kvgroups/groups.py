"""Layer groups: which layers share one cache format, and O(1) lookups into them.

``KVLayerGroupInfo`` and ``KVLayerGroupsManager`` keep LMCache's seed-era, mutable API (plain
lists a caller may sort or reassign, ``None`` on a missed lookup); what they add is typed
(``layout``, ``spec``, ``GroupKey``) and validated.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, TypeVar

import torch

from kvgroups.build import GroupKey, LayoutArg, plan_groups
from kvgroups.dtypes import dtype_from_name, dtype_name
from kvgroups.errors import KVGroupsError, StaleGroupsError
from kvgroups.formatting import compact_ranges
from kvgroups.kinds import LayerCacheSpec, LayerKind, default_spec, spec_from_dict
from kvgroups.layouts import CacheGeometry, KVLayout, detect_layout, geometry

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MANAGER_FORMAT = "kvgroups.manager/1"


class _Generation:
    """Bumped by every change to a group list or a group, so lookup indexes know they are stale.

    One process-wide counter keeps the check O(1) and survives copy and pickle (the tracked
    lists carry no reference to their owner).
    """

    value = 0


def _bump() -> None:
    _Generation.value += 1


class _TrackedList(list[_T]):
    """A list that reports every in-place change (sort, append, item assignment...)."""

    def __setitem__(self, *args: Any) -> None:
        list.__setitem__(self, *args)
        _bump()

    def __delitem__(self, *args: Any) -> None:
        list.__delitem__(self, *args)
        _bump()

    def __iadd__(self, other: Iterable[_T]) -> _TrackedList[_T]:  # type: ignore[override, misc]
        list.extend(self, other)
        _bump()
        return self

    def __imul__(self, count: SupportsIndex) -> _TrackedList[_T]:
        list.__imul__(self, count)
        _bump()
        return self

    def append(self, *args: Any) -> None:
        list.append(self, *args)
        _bump()

    def extend(self, *args: Any) -> None:
        list.extend(self, *args)
        _bump()

    def insert(self, *args: Any) -> None:
        list.insert(self, *args)
        _bump()

    def remove(self, *args: Any) -> None:
        list.remove(self, *args)
        _bump()

    def pop(self, *args: Any) -> _T:
        item: _T = list.pop(self, *args)
        _bump()
        return item

    def clear(self) -> None:
        list.clear(self)
        _bump()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        list.sort(self, *args, **kwargs)
        _bump()

    def reverse(self) -> None:
        list.reverse(self)
        _bump()

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickle as a tracked list again, without replaying appends.
        return (_TrackedList, (list(self),))


def _layout_from_shape(shape: torch.Size, owner: str) -> KVLayout:
    detected = detect_layout(torch.empty(shape, device="meta"))
    if detected is None:
        raise KVGroupsError(
            f"{owner}: cannot tell the layout of shape {list(shape)}; expected rank 5 with a K/V "
            f"axis of 2 at dim 0 or 1, or rank 3 (MLA); pass layout= for any other layout"
        )
    return detected


@dataclass(init=False, repr=False)
class KVLayerGroupInfo:
    """Layers whose caches share one shape, dtype, layout and kind.

    ``shape`` is one layer's cache tensor shape (for KV_SPLIT layouts: of the K tensor, which
    equals V's; for RECURRENT: ``[num_state_slots, state_elements]``). When ``layout`` is not
    given it is read from ``shape`` as :func:`~kvgroups.layouts.detect_layout` does; when ``spec``
    is not given it is MLA for MLA caches and full attention otherwise.
    """

    layer_names: list[str]
    layer_indices: list[int]
    shape: torch.Size
    dtype: torch.dtype
    layout: KVLayout
    spec: LayerCacheSpec
    _layer_indices_set: set[int] = field(default_factory=set, compare=False)
    _layer_names_set: set[str] = field(default_factory=set, compare=False)
    _sets_generation: int = field(default=-1, compare=False)
    _geometry_cache: tuple[torch.Size, KVLayout, CacheGeometry] | None = field(default=None, compare=False)

    def __init__(
        self,
        layer_names: Sequence[str],
        layer_indices: Sequence[int],
        shape: Sequence[int],
        dtype: torch.dtype,
        layout: KVLayout | None = None,
        spec: LayerCacheSpec | None = None,
    ) -> None:
        names = list(layer_names)
        indices = list(layer_indices)
        owner = f"KVLayerGroupInfo(layers {names[:3]}{'...' if len(names) > 3 else ''})"
        if len(names) != len(indices):
            raise KVGroupsError(
                f"{owner}: len(layer_names)={len(names)} != len(layer_indices)={len(indices)}; "
                f"each layer needs one name and one index"
            )
        bad_names = [name for name in names if not isinstance(name, str)]
        bad_indices = [
            index for index in indices
            if isinstance(index, bool) or not isinstance(index, int) or index < 0
        ]
        if bad_names or bad_indices:
            raise TypeError(
                f"{owner}: layer names must be str and layer indices non-negative ints; "
                f"offending names {bad_names!r}, offending indices {bad_indices!r}"
            )
        duplicate_names = sorted({name for name in names if names.count(name) > 1})
        duplicate_indices = sorted({index for index in indices if indices.count(index) > 1})
        if duplicate_names or duplicate_indices:
            raise KVGroupsError(
                f"{owner}: a layer may appear once per group; duplicate names {duplicate_names}, "
                f"duplicate indices {duplicate_indices}"
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{owner}: dtype must be a torch.dtype, got {dtype!r}")
        size = torch.Size(shape)
        if layout is None:
            layout = _layout_from_shape(size, owner)
        elif not isinstance(layout, KVLayout):
            raise TypeError(f"{owner}: layout must be a KVLayout, got {layout!r}")
        geometry(layout, size)  # raises on a rank that does not fit the layout
        if spec is None:
            spec = default_spec(layout)
        if not isinstance(getattr(spec, "kind", None), LayerKind):
            raise TypeError(f"{owner}: spec must be a layer cache spec, got {spec!r}")
        if not spec.accepts_layout(layout):
            raise KVGroupsError(
                f"{owner}: a {spec.kind.value} layer cannot be stored in layout {layout.value}"
            )
        self._init_fields(names, indices, size, dtype, layout, spec)

    def _init_fields(
        self, names: list[str], indices: list[int], shape: torch.Size, dtype: torch.dtype,
        layout: KVLayout, spec: LayerCacheSpec,
    ) -> None:
        self.layer_names = names
        self.layer_indices = indices
        self.shape = shape
        self.dtype = dtype
        self.layout = layout
        self.spec = spec
        self._sets_generation = -1
        self._geometry_cache = None

    @classmethod
    def _trusted(
        cls, names: list[str], indices: list[int], key: GroupKey
    ) -> KVLayerGroupInfo:
        """A group from values ``build_kv_layer_groups`` validated already."""
        group = cls.__new__(cls)
        group._init_fields(names, indices, key.shape, key.dtype, key.layout, key.spec)
        return group

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("layer_names", "layer_indices") and not isinstance(value, _TrackedList):
            value = _TrackedList(value)
        object.__setattr__(self, name, value)
        if not name.startswith("_"):
            _bump()

    def __repr__(self) -> str:
        indices = compact_ranges(self.layer_indices)
        return (
            f"KVLayerGroupInfo(layers={len(self.layer_names)}, indices={indices}, "
            f"shape={self.shape}, dtype={self.dtype}, layout={self.layout.value}, "
            f"kind={self.kind.value})"
        )

    # --- reference API -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def hidden_dim_size(self) -> int:
        """Elements per token per K or V plane: num_heads * head_size (head_size for MLA)."""
        return self.geometry.hidden_dim_size

    def contains_layer(self, layer_idx: int) -> bool:
        if self._sets_generation != _Generation.value:
            self._refresh_sets()
        return layer_idx in self._layer_indices_set

    def contains_layer_name(self, layer_name: str) -> bool:
        if self._sets_generation != _Generation.value:
            self._refresh_sets()
        return layer_name in self._layer_names_set

    def _refresh_sets(self) -> None:
        self._layer_indices_set = set(self.layer_indices)
        self._layer_names_set = set(self.layer_names)
        self._sets_generation = _Generation.value

    # --- additions -----------------------------------------------------------------------
    @property
    def geometry(self) -> CacheGeometry:
        # Asked for on every property access in hot paths; recomputed only when shape or layout
        # were replaced (both are immutable values, so identity tells).
        cached = self._geometry_cache
        if cached is None or cached[0] is not self.shape or cached[1] is not self.layout:
            cached = (self.shape, self.layout, geometry(self.layout, self.shape))
            self._geometry_cache = cached
        return cached[2]

    @property
    def kind(self) -> LayerKind:
        return self.spec.kind

    @property
    def kv_size(self) -> int:
        return self.geometry.kv_size

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def num_heads(self) -> int:
        return self.geometry.num_heads

    @property
    def head_size(self) -> int:
        return self.geometry.head_size

    @property
    def key(self) -> GroupKey:
        return GroupKey(shape=self.shape, dtype=self.dtype, layout=self.layout, spec=self.spec)

    def chunk_shape(self, num_tokens: int) -> torch.Size:
        """``[kv_size, num_layers, num_tokens, hidden_dim_size]`` of a stored chunk.

        A recurrent group stores one state per sequence, whatever the token count:
        ``[1, num_layers, 1, state_elements]``.
        """
        if not self.layout.is_token_indexed:
            num_tokens = 1
        return torch.Size([self.kv_size, self.num_layers, num_tokens, self.hidden_dim_size])

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_names": list(self.layer_names),
            "layer_indices": list(self.layer_indices),
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "layout": self.layout.value,
            "spec": self.spec.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayerGroupInfo:
        missing = [
            name for name in ("layer_names", "layer_indices", "shape", "dtype", "layout", "spec")
            if name not in data
        ]
        if missing:
            raise KVGroupsError(f"group dict lacks fields {missing}")
        return cls(
            layer_names=data["layer_names"],
            layer_indices=data["layer_indices"],
            shape=data["shape"],
            dtype=dtype_from_name(data["dtype"]),
            layout=KVLayout.parse(data["layout"]),
            spec=spec_from_dict(data["spec"]),
        )


@dataclass
class KVLayerGroupsManager:
    """The groups of one model's layers, with O(1) lookups by layer index and name.

    ``kv_layer_groups`` is a plain list to the caller: sorting it, assigning to it or mutating a
    group's layer lists is seen by the lookups.
    """

    kv_layer_groups: list[KVLayerGroupInfo] = field(default_factory=list)
    _by_index: dict[int, KVLayerGroupInfo] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _by_name: dict[str, KVLayerGroupInfo] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _index_generation: int = field(default=-1, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "kv_layer_groups":
            if not isinstance(value, list):
                raise TypeError(f"kv_layer_groups must be a list, got {type(value).__name__}")
            if not isinstance(value, _TrackedList):
                value = _TrackedList(value)
            _bump()
        object.__setattr__(self, name, value)

    @property
    def num_groups(self) -> int:
        return len(self.kv_layer_groups)

    def _reindex(self) -> None:
        by_index: dict[int, KVLayerGroupInfo] = {}
        by_name: dict[str, KVLayerGroupInfo] = {}
        # First group wins where a caller's edits left a layer in two, as a linear scan would.
        for group in self.kv_layer_groups:
            for index in group.layer_indices:
                by_index.setdefault(index, group)
            for name in group.layer_names:
                by_name.setdefault(name, group)
        self._by_index = by_index
        self._by_name = by_name
        self._index_generation = _Generation.value

    def get_group_by_layer_idx(self, layer_idx: int) -> KVLayerGroupInfo | None:
        if self._index_generation != _Generation.value:
            self._reindex()
        return self._by_index.get(layer_idx)

    def get_group_by_layer_name(self, layer_name: str) -> KVLayerGroupInfo | None:
        if self._index_generation != _Generation.value:
            self._reindex()
        return self._by_name.get(layer_name)

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


__all__ = ["GroupKey", "KVLayerGroupInfo", "KVLayerGroupsManager"]
