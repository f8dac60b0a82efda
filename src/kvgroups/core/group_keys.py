"""What one layer's cache value is, decided once where caches enter the API.

A layer's value is one tensor (keys and values in one tensor, or an MLA latent), a ``(k, v)``
pair, or for a recurrent layer a tensor or tuple of state tensors ``[num_state_slots,
*state_shape]``. :func:`layer_key` reads a value into the :class:`GroupKey` the grouping planner
buckets layers by; :func:`check_layer` checks a value against the key its group was built with,
which is how the data path binds caches. Both hand the value on as a tuple of tensors, the one
form the copy code takes. Only shapes, dtypes and devices are read, never data: meta tensors work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgroups.core.cache_specs import LayerCacheSpec, default_spec
from kvgroups.core.formatting import describe_value
from kvgroups.core.layouts import Axis, KVLayout, detect_layout, geometry, layout_from_shape
from kvgroups.errors import KVGroupsError

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class GroupKey:
    """Everything that makes two layers' caches interchangeable for storage and reuse.

    ``shape`` is one layer's per-tensor cache shape (for a recurrent layer ``[num_state_slots,
    state_elements]``): it includes num_blocks, because layers with a different number of blocks
    cannot share one slot mapping. ``dtype`` is what a chunk's bytes are read as. ``layout`` says
    where a token's rows sit in the tensor. ``spec`` says which tokens a layer keeps, because the
    rules for reusing a full, sliding, chunked, MLA or recurrent cache differ. ``value_head_size``
    is the values' head size where it differs from the keys' (None: the same); a ``(k, v)`` pair's
    ``shape`` is then the keys'.
    """

    shape: torch.Size
    dtype: torch.dtype
    layout: KVLayout
    spec: LayerCacheSpec
    value_head_size: int | None = None

    @property
    def tensors_per_layer(self) -> int:
        """Tensors one layer's value holds: 2 for K/V pairs, one per state, else 1."""
        return self.layout.tensors_per_layer or len(self.spec.state_shapes)

    def describe(self) -> str:
        """What a layer of this key is handed as, for error messages."""
        if not self.spec.token_indexed:
            shapes = ", ".join(f"[{self.shape[0]}, {', '.join(map(str, shape))}]" for shape in self.spec.state_shapes)
            return f"{len(self.spec.state_shapes)} state tensor(s) {shapes} {self.dtype}"
        values = f" (values of head size {self.value_head_size})" if self.value_head_size is not None else ""
        return (f"{self.tensors_per_layer} tensor(s) {list(self.shape)} {self.dtype} in layout {self.layout.value}"
                f"{values}")

    @property
    def tensor_shapes(self) -> tuple[torch.Size, ...]:
        """The shape of each tensor of a token-indexed layer (a pair's V tensor may differ in its last axis)."""
        if self.tensors_per_layer == 2 and self.value_head_size is not None:
            return self.shape, torch.Size([*self.shape[:-1], self.value_head_size])
        return (self.shape,) * self.tensors_per_layer


class LayerTypeError(TypeError):
    """A layer's value is not made of tensors; the message says what it is."""


class LayerValueError(KVGroupsError):
    """A layer's tensors do not fit its layout or spec; the message says why."""


def as_tensors(value: object) -> Tensors | None:
    """A tensor, or a list or tuple of tensors, as a tuple of tensors; anything else None."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, torch.Tensor) for item in value):
        return tuple(value)
    return None


def layer_key(value: object, layout: KVLayout | None, spec: LayerCacheSpec | None,
              value_head_size: int | None = None) -> tuple[GroupKey, Tensors]:
    """The grouping key of one layer's cache value, and the value as tensors.

    ``layout`` None is detected from the value; ``spec`` None is the layout's default (MLA for
    MLA caches, full attention otherwise). ``value_head_size`` says where a vLLM page's keys end
    (a ``(k, v)`` pair shows it in its V tensor). Raises :class:`LayerTypeError` or
    :class:`LayerValueError`; the caller says which layer.
    """
    if spec is not None and not spec.token_indexed:
        if layout not in (None, KVLayout.RECURRENT):
            raise LayerValueError(f"a recurrent layer cannot be given layout {layout.value}")
        if value_head_size is not None:
            raise LayerValueError(f"a recurrent layer has no values, got value_head_size={value_head_size!r}")
        states = _states(value, spec)
        first = states[0]
        shape = torch.Size([first.shape[0], spec.state_elements])
        return GroupKey(shape=shape, dtype=first.dtype, layout=KVLayout.RECURRENT, spec=spec), states
    if layout is None:
        layout = detect_layout(value)
        if layout is None:
            if isinstance(value, torch.Tensor):
                try:
                    layout_from_shape(value.shape)
                except KVGroupsError as error:
                    raise LayerValueError(str(error)) from None
            raise LayerTypeError(f"expected a tensor or a (k, v) pair of tensors, got {describe_value(value)}")
    if layout is KVLayout.RECURRENT:
        raise LayerValueError("layout recurrent needs a RecurrentState spec for the layer")
    if layout.tensors_per_layer == 2:
        tensors = _kv_pair(value, layout)
        paired = int(tensors[1].shape[-1])
        if value_head_size is not None and value_head_size != paired:
            raise LayerValueError(f"value_head_size={value_head_size} but the V tensor's head size is {paired}")
        value_head_size = paired
    else:
        tensors = _single_tensor(value, layout, value_head_size)
    if spec is None:
        spec = default_spec(layout)
    elif not spec.accepts_layout(layout):
        raise LayerValueError(f"a {spec.kind.value} layer cannot be stored in layout {layout.value}")
    first = tensors[0]
    try:
        sizes = geometry(layout, first.shape, value_head_size)
    except KVGroupsError as error:
        raise LayerValueError(str(error)) from None
    return GroupKey(shape=first.shape, dtype=first.dtype, layout=layout, spec=spec,
                    value_head_size=sizes.value_head_size), tensors


def check_layer(key: GroupKey, value: object) -> Tensors:
    """``value`` as tensors when it is what a layer of a group built with ``key`` holds.

    Raises :class:`~kvgroups.errors.KVGroupsError` saying what ``value`` is and what the group
    expects; the caller says which layer.
    """
    # The common case, one tensor of the group's shape and dtype, costs a few comparisons.
    if isinstance(value, torch.Tensor) and key.layout.tensors_per_layer == 1:
        if value.shape == key.shape and value.dtype == key.dtype:
            problem = key.layout.layout_problem(value, key.value_head_size)
            if problem is None:
                return (value,)
            raise KVGroupsError(f"is {describe_value(value)}, but {problem}")
    else:
        tensors = as_tensors(value)
        if tensors is not None and _fits(key, tensors):
            return tensors
    raise KVGroupsError(f"is {describe_value(value)}; the group expects {key.describe()}")


def kv_planes(layout: KVLayout, tensors: Tensors) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, plane index within it)`` of each K/V plane of a token-indexed layer's tensors."""
    if layout.tensors_per_layer == 2:
        return [(tensors[0], 0), (tensors[1], 0)]
    return [(tensors[0], plane) for plane in range(layout.kv_size)]


def _fits(key: GroupKey, tensors: Tensors) -> bool:
    if key.spec.token_indexed:
        return len(tensors) == key.tensors_per_layer and all(
            tensor.shape == shape and tensor.dtype == key.dtype
            for tensor, shape in zip(tensors, key.tensor_shapes, strict=True)
        )
    shapes = key.spec.state_shapes
    return len(tensors) == len(shapes) and all(
        tensor.dim() == len(shape) + 1 and tensor.shape[0] == key.shape[0] and tuple(tensor.shape[1:]) == shape
        and tensor.dtype == key.dtype
        for tensor, shape in zip(tensors, shapes, strict=True)
    )


def _single_tensor(value: object, layout: KVLayout, value_head_size: int | None) -> Tensors:
    if not isinstance(value, torch.Tensor):
        raise LayerTypeError(f"layout {layout.value} takes one tensor, got {describe_value(value)}")
    axes = layout.axes
    if value.dim() != len(axes):
        raise LayerValueError(
            f"rank {value.dim()} {list(value.shape)} does not fit layout {layout.value} {layout.axes_text}"
        )
    if Axis.KV in axes and value.shape[axes.index(Axis.KV)] != 2:
        raise LayerValueError(
            f"shape {list(value.shape)} in layout {layout.value} needs 2 at the K/V axis (dim {axes.index(Axis.KV)})"
        )
    problem = layout.layout_problem(value, value_head_size)
    if problem is not None:
        raise LayerValueError(f"{describe_value(value)} does not fit layout {layout.value}: {problem}")
    return (value,)


def _kv_pair(value: object, layout: KVLayout) -> Tensors:
    tensors = as_tensors(value) if isinstance(value, (list, tuple)) else None
    if tensors is None or len(tensors) != 2:
        raise LayerTypeError(f"layout {layout.value} takes a (k, v) pair of tensors, got {describe_value(value)}")
    key, val = tensors
    if key.shape[:-1] != val.shape[:-1] or key.dtype != val.dtype or key.device != val.device:
        raise LayerValueError(
            f"K {describe_value(key)} and V {describe_value(val)} differ; "
            f"K and V of one layer must match in dtype, device and shape (but for the head size)"
        )
    if key.dim() != len(layout.axes):
        raise LayerValueError(
            f"K/V tensors of rank {key.dim()} {list(key.shape)} do not fit layout {layout.value} {layout.axes_text}"
        )
    return tensors


def _states(value: object, spec: LayerCacheSpec) -> Tensors:
    states = as_tensors(value)
    if states is None:
        raise LayerTypeError(f"a recurrent layer takes a tensor or tuple of state tensors, got {describe_value(value)}")
    expected = [list(shape) for shape in spec.state_shapes]
    if len(states) != len(expected):
        raise LayerValueError(f"{len(states)} state tensors given, the spec lists {len(expected)}: {expected}")
    first = states[0]
    for position, (state, state_shape) in enumerate(zip(states, expected, strict=True)):
        if state.dim() < 2 or list(state.shape[1:]) != state_shape:
            raise LayerValueError(
                f"state {position} is {describe_value(state)}; expected "
                f"[num_state_slots, {', '.join(map(str, state_shape))}]"
            )
        if (state.shape[0], state.dtype, state.device) != (first.shape[0], first.dtype, first.device):
            raise LayerValueError(
                f"state {position} {describe_value(state)} differs from state 0 "
                f"{describe_value(first)} in slots, dtype or device"
            )
    return states
