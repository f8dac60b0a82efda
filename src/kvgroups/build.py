"""From live caches to a grouping plan: validate every layer, then bucket layers by GroupKey.

Validation runs over all layers before anything is decided, so one error lists every offender.
Only shapes, dtypes and devices are read, never tensor data: meta tensors work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.errors import KVGroupsError
from kvgroups.formatting import compact_ranges, describe_value
from kvgroups.kinds import FullAttention, LayerCacheSpec, LayerKind, MLAttention, RecurrentState
from kvgroups.layouts import Axis, KVLayout, detect_layout

LayoutArg = KVLayout | Mapping[str, KVLayout] | None


@dataclass(frozen=True, kw_only=True)
class GroupKey:
    """Everything that makes two layers' caches interchangeable for storage and reuse.

    ``shape`` is one layer's per-tensor cache shape (it includes num_blocks: layers with a
    different number of blocks cannot share one slot mapping).
    """

    shape: torch.Size
    dtype: torch.dtype
    layout: KVLayout
    spec: LayerCacheSpec


PlannedGroup = tuple[GroupKey, list[str], list[int]]

_FULL = FullAttention()
_MLA = MLAttention()


class _LayerTypeError(Exception):
    pass


class _LayerValueError(Exception):
    pass


def _single_tensor(value: object, layout: KVLayout) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _LayerTypeError(f"layout {layout.value} takes one tensor, got {describe_value(value)}")
    axes = layout.axes
    if value.dim() != len(axes):
        raise _LayerValueError(
            f"rank {value.dim()} {list(value.shape)} does not fit layout {layout.value} "
            f"[{', '.join(axis.value for axis in axes)}]"
        )
    if Axis.KV in axes and value.shape[axes.index(Axis.KV)] != 2:
        raise _LayerValueError(
            f"shape {list(value.shape)} in layout {layout.value} needs 2 at the K/V axis "
            f"(dim {axes.index(Axis.KV)})"
        )
    return value


def _kv_pair(value: object, layout: KVLayout) -> torch.Tensor:
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(item, torch.Tensor) for item in value)
    ):
        raise _LayerTypeError(f"layout {layout.value} takes a (k, v) pair of tensors, "
                              f"got {describe_value(value)}")
    key: torch.Tensor = value[0]
    val: torch.Tensor = value[1]
    if key.shape != val.shape or key.dtype != val.dtype or key.device != val.device:
        raise _LayerValueError(
            f"K {describe_value(key)} and V {describe_value(val)} differ; "
            f"K and V of one layer must match in shape, dtype and device"
        )
    if key.dim() != len(layout.axes):
        raise _LayerValueError(
            f"K/V tensors of rank {key.dim()} {list(key.shape)} do not fit layout {layout.value} "
            f"[{', '.join(axis.value for axis in layout.axes)}]"
        )
    return key


def _recurrent_states(value: object, spec: RecurrentState) -> tuple[torch.Tensor, torch.Size]:
    states = (value,) if isinstance(value, torch.Tensor) else value
    if not (
        isinstance(states, (list, tuple))
        and all(isinstance(item, torch.Tensor) for item in states)
    ):
        raise _LayerTypeError(
            f"a recurrent layer takes a tensor or tuple of state tensors, got {describe_value(value)}"
        )
    expected = [list(shape) for shape in spec.state_shapes]
    if len(states) != len(expected):
        raise _LayerValueError(
            f"{len(states)} state tensors given, the spec lists {len(expected)}: {expected}"
        )
    first = states[0]
    for position, (state, state_shape) in enumerate(zip(states, expected, strict=True)):
        if state.dim() < 2 or list(state.shape[1:]) != state_shape:
            raise _LayerValueError(
                f"state {position} is {describe_value(state)}; expected "
                f"[num_state_slots, {', '.join(map(str, state_shape))}]"
            )
        if (state.shape[0], state.dtype, state.device) != (first.shape[0], first.dtype, first.device):
            raise _LayerValueError(
                f"state {position} {describe_value(state)} differs from state 0 "
                f"{describe_value(first)} in slots, dtype or device"
            )
    return first, torch.Size([first.shape[0], spec.state_elements])


def _layer_key(
    value: object, layout: KVLayout | None, spec: LayerCacheSpec | None
) -> tuple[tuple[Any, ...], torch.device]:
    """The grouping key of one layer and the device its cache lives on."""
    if isinstance(spec, RecurrentState):
        if layout not in (None, KVLayout.RECURRENT):
            raise _LayerValueError(f"a recurrent layer cannot be given layout {layout.value}")
        first, shape = _recurrent_states(value, spec)
        return (shape, first.dtype, KVLayout.RECURRENT, spec), first.device
    if layout is None:
        layout = detect_layout(value)
        if layout is None:
            if isinstance(value, torch.Tensor):
                raise _LayerValueError(
                    f"cannot tell the layout of {describe_value(value)}: expected rank 5 with 2 at "
                    f"dim 0 (flash_attn) or dim 1 (flashinfer), rank 3 (mla), or a (k, v) pair; "
                    f"pass layout= for HND or other layouts"
                )
            raise _LayerTypeError(
                f"expected a tensor or a (k, v) pair of tensors, got {describe_value(value)}"
            )
    if layout is KVLayout.RECURRENT:
        raise _LayerValueError("layout recurrent needs a RecurrentState spec for the layer")
    tensor = _kv_pair(value, layout) if layout.tensors_per_layer == 2 else _single_tensor(value, layout)
    if spec is None:
        spec = _MLA if layout is KVLayout.MLA else _FULL
    elif not spec.accepts_layout(layout):
        raise _LayerValueError(f"a {spec.kind.value} layer cannot be stored in layout {layout.value}")
    return (tensor.shape, tensor.dtype, layout, spec), tensor.device


def _check_arguments(
    kv_caches: Mapping[str, Any],
    layer_specs: Mapping[str, LayerCacheSpec] | None,
    layout: LayoutArg,
) -> None:
    if not isinstance(kv_caches, Mapping):
        raise TypeError(f"kv_caches must be a dict of layer name -> cache, got {type(kv_caches).__name__}")
    bad_names = [name for name in kv_caches if not isinstance(name, str)]
    if bad_names:
        raise TypeError(f"layer names must be str; offending keys {bad_names!r}")
    if layer_specs is not None:
        if not isinstance(layer_specs, Mapping):
            raise TypeError(f"layer_specs must be a dict of layer name -> spec, got {type(layer_specs).__name__}")
        unknown = [name for name in layer_specs if name not in kv_caches]
        if unknown:
            raise KVGroupsError(f"layer_specs names layers that kv_caches lacks: {unknown}")
        bad_specs = [
            f"{name!r}: {spec!r}" for name, spec in layer_specs.items()
            if not isinstance(getattr(spec, "kind", None), LayerKind)
        ]
        if bad_specs:
            raise TypeError(
                f"layer_specs values must be layer cache specs (FullAttention, SlidingWindow, "
                f"ChunkedLocal, MLAttention, RecurrentState); offending {', '.join(bad_specs)}"
            )
    if isinstance(layout, Mapping):
        unknown = [name for name in layout if name not in kv_caches]
        if unknown:
            raise KVGroupsError(f"layout names layers that kv_caches lacks: {unknown}")
        bad_layouts = [f"{name!r}: {value!r}" for name, value in layout.items()
                       if not isinstance(value, KVLayout)]
        if bad_layouts:
            raise TypeError(f"layout values must be KVLayout members; offending {', '.join(bad_layouts)}")
    elif layout is not None and not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a KVLayout, a dict of them, or None; got {layout!r}")


def _devices(kv_caches: Mapping[str, Any]) -> str:
    layers_by_device: dict[str, list[int]] = {}
    for index, value in enumerate(kv_caches.values()):
        tensors = [value] if isinstance(value, torch.Tensor) else list(value)
        for device in {str(tensor.device) for tensor in tensors}:
            layers_by_device.setdefault(device, []).append(index)
    return "; ".join(
        f"{device}: layers {compact_ranges(indices)}" for device, indices in layers_by_device.items()
    )


def plan_groups(
    kv_caches: Mapping[str, Any],
    layer_specs: Mapping[str, LayerCacheSpec] | None,
    layout: LayoutArg,
) -> list[PlannedGroup]:
    """Validate every layer of ``kv_caches`` and bucket them into groups ordered by first layer."""
    _check_arguments(kv_caches, layer_specs, layout)
    specs = layer_specs or {}
    per_layer = layout if isinstance(layout, Mapping) else None
    every_layer = layout if isinstance(layout, KVLayout) else None
    type_errors: list[str] = []
    value_errors: list[str] = []
    buckets: dict[tuple[Any, ...], tuple[list[str], list[int]]] = {}
    # Most layers are a plain tensor with no explicit layout or spec; their bucket follows from
    # (shape, dtype) alone, which skips re-validating every layer of a 1000-layer model.
    plain_buckets: dict[tuple[torch.Size, torch.dtype], tuple[list[str], list[int]]] = {}
    first_device: torch.device | None = None
    mixed_devices = False
    for index, (name, value) in enumerate(kv_caches.items()):
        if layout is None and isinstance(value, torch.Tensor) and name not in specs:
            plain_key = (value.shape, value.dtype)
            bucket = plain_buckets.get(plain_key)
            device = value.device
            if bucket is not None:
                bucket[0].append(name)
                bucket[1].append(index)
                if device != first_device:
                    mixed_devices = True
                continue
        layer_layout = per_layer.get(name) if per_layer is not None else every_layer
        try:
            key, device = _layer_key(value, layer_layout, specs.get(name))
        except _LayerTypeError as error:
            type_errors.append(f"layer {index} {name!r}: {error}")
            continue
        except _LayerValueError as error:
            value_errors.append(f"layer {index} {name!r}: {error}")
            continue
        if first_device is None:
            first_device = device
        elif device != first_device:
            mixed_devices = True
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = ([], [])
        bucket[0].append(name)
        bucket[1].append(index)
        if layout is None and isinstance(value, torch.Tensor) and name not in specs:
            plain_buckets[(value.shape, value.dtype)] = bucket
    if type_errors:
        raise TypeError("bad KV caches: " + "; ".join(type_errors))
    if value_errors:
        raise KVGroupsError("bad KV caches: " + "; ".join(value_errors))
    if mixed_devices:
        raise KVGroupsError(f"KV caches must all be on one device, found {_devices(kv_caches)}")
    # dicts keep insertion order, so buckets are already ordered by their first layer index.
    return [
        (GroupKey(shape=shape, dtype=dtype, layout=key_layout, spec=spec), names, indices)
        for (shape, dtype, key_layout, spec), (names, indices) in buckets.items()
    ]
