"""``KVLayerGroupInfo``: the layers whose caches share one shape, dtype, layout and kind.

It keeps LMCache's seed-era, mutable API (plain lists a caller may sort or reassign); what it
adds is typed (``layout``, ``spec``, ``GroupKey``), validated, and the group's own sizes: its
geometry, its chunk shape and its byte counts, each defined here once.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvgroups.core.cache_specs import LayerCacheSpec, LayerKind, default_spec, spec_from_dict
from kvgroups.core.checks import is_int_at_least
from kvgroups.core.dtypes import dtype_from_name, dtype_name
from kvgroups.core.formatting import compact_ranges
from kvgroups.core.group_keys import GroupKey
from kvgroups.core.layouts import CacheGeometry, KVLayout, geometry, layout_from_shape
from kvgroups.core.tracked_lists import Owner, TrackedList, tracked
from kvgroups.errors import KVGroupsError


@dataclass(init=False, repr=False)
class KVLayerGroupInfo:
    """Layers whose caches share one shape, dtype, layout and kind.

    ``shape`` is one layer's cache tensor shape (for KV_SPLIT layouts: of the K tensor, which
    equals V's; for RECURRENT: ``[num_state_slots, state_elements]``). When ``layout`` is not
    given it is read from ``shape`` as :func:`~kvgroups.core.layouts.detect_layout` does; when ``spec``
    is not given it is MLA for MLA caches and full attention otherwise. ``value_head_size`` is the
    values' head size where it differs from the keys' (MiMo-V2: 192 / 128), in a layout that holds
    it unpadded (a ``(k, v)`` pair, whose ``shape`` is then the keys', or a vLLM page of
    ``head_size + value_head_size``); None where they are equal, as for every LMCache group.
    """

    layer_names: list[str]
    layer_indices: list[int]
    shape: torch.Size
    dtype: torch.dtype
    layout: KVLayout
    spec: LayerCacheSpec
    value_head_size: int | None
    # Bumped by every edit; the membership sets remember the version they were built from.
    _version: int = field(default=0, compare=False)
    _sets: tuple[int, set[int], set[str]] = field(default=(-1, set(), set()), compare=False)
    # The managers whose lookup index holds this group (weakly): an edit re-indexes exactly those.
    _managers: tuple[weakref.ref[Owner], ...] = field(default=(), compare=False)
    _geometry_cache: tuple[torch.Size, KVLayout, int | None, CacheGeometry] | None = field(default=None, compare=False)

    def __init__(
        self,
        layer_names: Sequence[str],
        layer_indices: Sequence[int],
        shape: Sequence[int],
        dtype: torch.dtype,
        layout: KVLayout | None = None,
        spec: LayerCacheSpec | None = None,
        *,
        value_head_size: int | None = None,
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
        bad_indices = [index for index in indices if not is_int_at_least(index, 0)]
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
            try:
                layout = layout_from_shape(size)
            except KVGroupsError as error:
                raise KVGroupsError(f"{owner}: {error}") from None
        elif not isinstance(layout, KVLayout):
            raise TypeError(f"{owner}: layout must be a KVLayout, got {layout!r}")
        try:
            sizes = geometry(layout, size, value_head_size)  # raises on a rank that does not fit the layout
        except KVGroupsError as error:
            raise KVGroupsError(f"{owner}: {error}") from None
        if spec is None:
            spec = default_spec(layout)
        if not isinstance(getattr(spec, "kind", None), LayerKind):
            raise TypeError(f"{owner}: spec must be a layer cache spec, got {spec!r}")
        if not spec.accepts_layout(layout):
            raise KVGroupsError(
                f"{owner}: a {spec.kind.value} layer cannot be stored in layout {layout.value}"
            )
        self._init_fields(names, indices, size, dtype, layout, spec, sizes.value_head_size)

    def _init_fields(
        self, names: list[str], indices: list[int], shape: torch.Size, dtype: torch.dtype,
        layout: KVLayout, spec: LayerCacheSpec, value_head_size: int | None,
    ) -> None:
        # object.__setattr__, not self.__dict__: touching __dict__ would slow every later attribute read.
        initial: dict[str, Any] = {
            "_managers": (), "_geometry_cache": None, "_version": 0, "_sets": (-1, set(), set()),
            "layer_names": TrackedList(names, self), "layer_indices": TrackedList(indices, self),
            "shape": shape, "dtype": dtype, "layout": layout, "spec": spec, "value_head_size": value_head_size,
        }
        for name, value in initial.items():
            object.__setattr__(self, name, value)

    @classmethod
    def _trusted(
        cls, names: list[str], indices: list[int], key: GroupKey
    ) -> KVLayerGroupInfo:
        """A group from values ``build_kv_layer_groups`` validated already."""
        group = cls.__new__(cls)
        group._init_fields(names, indices, key.shape, key.dtype, key.layout, key.spec, key.value_head_size)
        return group

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("layer_names", "layer_indices"):
            value = tracked(value, self)
        object.__setattr__(self, name, value)
        if not name.startswith("_"):
            self._changed()

    def _changed(self) -> None:
        self._version += 1
        for reference in self._managers:
            manager = reference()
            if manager is not None:
                manager._changed()

    def _held_by(self, manager: Owner) -> None:
        if any(reference() is manager for reference in self._managers):
            return
        # Plain weak references (a manager is asked for on every edit, rarely added): cheaper to
        # make than a WeakValueDictionary, which building a manager's groups would pay per group.
        live = tuple(reference for reference in self._managers if reference() is not None)
        object.__setattr__(self, "_managers", (*live, weakref.ref(manager)))

    def __getstate__(self) -> dict[str, Any]:
        # A copy is held by no manager yet (managers reindex their copies and register then).
        return {**{item.name: getattr(self, item.name) for item in fields(self)}, "_managers": ()}

    def __repr__(self) -> str:
        indices = compact_ranges(self.layer_indices)
        values = f", value_head_size={self.value_head_size}" if self.value_head_size is not None else ""
        return (
            f"KVLayerGroupInfo(layers={len(self.layer_names)}, indices={indices}, "
            f"shape={self.shape}, dtype={self.dtype}, layout={self.layout.value}, "
            f"kind={self.kind.value}{values})"
        )

    # --- reference API -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def hidden_dim_size(self) -> int:
        """Elements per token per K or V plane: num_heads * head_size (head_size for MLA); the keys'
        plane where values have a head size of their own (:attr:`value_hidden_dim_size`)."""
        return self.geometry.hidden_dim_size

    def contains_layer(self, layer_idx: int) -> bool:
        sets = self._sets if self._sets[0] == self._version else self._refresh_sets()
        return layer_idx in sets[1]

    def contains_layer_name(self, layer_name: str) -> bool:
        sets = self._sets if self._sets[0] == self._version else self._refresh_sets()
        return layer_name in sets[2]

    def _refresh_sets(self) -> tuple[int, set[int], set[str]]:
        # The version is read before the sets are built, so an edit meanwhile leaves them stale.
        self._sets = (self._version, set(self.layer_indices), set(self.layer_names))
        return self._sets

    # --- additions -----------------------------------------------------------------------
    @property
    def geometry(self) -> CacheGeometry:
        # Asked for on every property access in hot paths; recomputed only when shape or layout
        # were replaced (both are immutable values, so identity tells).
        cached = self._geometry_cache
        if (cached is None or cached[0] is not self.shape or cached[1] is not self.layout
                or cached[2] != self.value_head_size):
            cached = (self.shape, self.layout, self.value_head_size,
                      geometry(self.layout, self.shape, self.value_head_size))
            self._geometry_cache = cached
        return cached[3]

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
    def value_hidden_dim_size(self) -> int:
        """Elements per token per V plane (``hidden_dim_size`` unless values have a head size of their own)."""
        return self.geometry.value_hidden_dim_size

    @property
    def key(self) -> GroupKey:
        return GroupKey(shape=self.shape, dtype=self.dtype, layout=self.layout, spec=self.spec,
                        value_head_size=self.value_head_size)

    @property
    def token_indexed(self) -> bool:
        """Whether the group's caches are addressed by token slots (False: recurrent state)."""
        return self.spec.token_indexed

    @property
    def slot_bytes(self) -> int:
        """Bytes one token slot (one state slot) of one layer holds, K/V planes together."""
        return self.geometry.slot_elements * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> float:
        """What one more token of context costs all layers of the group (0 for recurrent state; a fraction
        for compressed rows, one per several tokens)."""
        return self.spec.bytes_per_token(self.slot_bytes) * self.num_layers

    @property
    def bytes_per_sequence(self) -> int:
        """What one more sequence costs all layers of the group whatever its length (recurrent state)."""
        return self.spec.bytes_per_sequence(self.slot_bytes) * self.num_layers

    def chunk_shape(self, num_tokens: int, num_states: int = 1) -> torch.Size:
        """``[kv_size, num_layers, num_tokens, hidden_dim_size]`` of a stored chunk of ``num_tokens`` tokens.

        A group of compressed rows stores the rows the chunk completes (room for ``ceil(num_tokens /
        tokens_per_row)``). A recurrent group stores states, not tokens: ``[1, num_layers, num_states,
        state_elements]``, one state per sequence (a stored chunk holds one). A group whose values
        have a head size of their own stores no padding: ``[1, num_layers, num_tokens,
        hidden_dim_size + value_hidden_dim_size]``, each token's row its keys then its values.
        """
        return self.slots_shape(self.spec.chunk_slots(num_tokens), num_states)

    def slots_shape(self, num_slots: int, num_states: int = 1) -> torch.Size:
        """What :meth:`chunk_shape` says for ``num_slots`` slots (tokens; compressed rows) moved at once."""
        rows = num_slots if self.spec.token_indexed else num_states
        if self.value_head_size is not None:
            return torch.Size([1, self.num_layers, rows, self.geometry.slot_elements])
        return torch.Size([self.kv_size, self.num_layers, rows, self.hidden_dim_size])

    def chunk_bytes(self, num_tokens: int) -> int:
        """Bytes of one stored chunk of ``num_tokens`` tokens (one state for a recurrent group)."""
        return math.prod(self.chunk_shape(num_tokens)) * self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        described = {
            "layer_names": list(self.layer_names),
            "layer_indices": list(self.layer_indices),
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "layout": self.layout.value,
            "spec": self.spec.to_dict(),
        }
        if self.value_head_size is not None:  # absent where equal: every other group's dict as before
            described["value_head_size"] = self.value_head_size
        return described

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
            value_head_size=data.get("value_head_size"),
        )
