"""The grouping planner: from live caches to groups, every layer validated, then bucketed by GroupKey.

Validation runs over all layers before anything is decided, so one error lists every offender.
What a layer's value is and which key it has is :mod:`kvgroups.core.group_keys`' call; this module
checks the arguments, collects the errors and buckets. Only shapes, dtypes and devices are read,
never tensor data: meta tensors work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvgroups.core.cache_specs import LayerCacheSpec, LayerKind
from kvgroups.core.formatting import compact_ranges
from kvgroups.core.group_keys import GroupKey, LayerTypeError, LayerValueError, as_tensors, layer_key
from kvgroups.core.layouts import KVLayout
from kvgroups.errors import KVGroupsError

LayoutArg = KVLayout | Mapping[str, KVLayout] | None
ValueHeadSizeArg = int | Mapping[str, int] | None

PlannedGroup = tuple[GroupKey, list[str], list[int]]


def _check_arguments(
    kv_caches: Mapping[str, Any],
    layer_specs: Mapping[str, LayerCacheSpec] | None,
    layout: LayoutArg,
    value_head_size: ValueHeadSizeArg = None,
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
    sizes = value_head_size if isinstance(value_head_size, Mapping) else {"": value_head_size}
    if isinstance(value_head_size, Mapping):
        unknown = [name for name in value_head_size if name not in kv_caches]
        if unknown:
            raise KVGroupsError(f"value_head_size names layers that kv_caches lacks: {unknown}")
    bad_sizes = [f"{name!r}: {size!r}" if name else repr(size) for name, size in sizes.items()
                 if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1)]
    if bad_sizes:
        raise TypeError(f"value_head_size must be a positive int, a dict of them, or None; offending "
                        f"{', '.join(bad_sizes)}")


def _devices(kv_caches: Mapping[str, Any]) -> str:
    layers_by_device: dict[str, list[int]] = {}
    for index, value in enumerate(kv_caches.values()):
        for device in {str(tensor.device) for tensor in as_tensors(value) or ()}:
            layers_by_device.setdefault(device, []).append(index)
    return "; ".join(
        f"{device}: layers {compact_ranges(indices)}" for device, indices in layers_by_device.items()
    )


def plan_groups(
    kv_caches: Mapping[str, Any],
    layer_specs: Mapping[str, LayerCacheSpec] | None,
    layout: LayoutArg,
    value_head_size: ValueHeadSizeArg = None,
) -> list[PlannedGroup]:
    """Validate every layer of ``kv_caches`` and bucket them into groups ordered by first layer.

    ``value_head_size`` (one for every layer, or per layer name) is the values' head size of
    layers in a vLLM page layout whose values differ from their keys.
    """
    _check_arguments(kv_caches, layer_specs, layout, value_head_size)
    specs = layer_specs or {}
    per_layer = layout if isinstance(layout, Mapping) else None
    every_layer = layout if isinstance(layout, KVLayout) else None
    value_sizes: Mapping[str, int] = value_head_size if isinstance(value_head_size, Mapping) else {}
    every_value_size = value_head_size if isinstance(value_head_size, int) else None
    type_errors: list[str] = []
    value_errors: list[str] = []
    buckets: dict[GroupKey, tuple[list[str], list[int]]] = {}
    # Most layers are a plain tensor with no explicit layout or spec; their bucket follows from
    # (shape, dtype) alone, which skips re-validating every layer of a 1000-layer model.
    plain_buckets: dict[tuple[torch.Size, torch.dtype], tuple[list[str], list[int]]] = {}
    first_device: torch.device | None = None
    mixed_devices = False
    for index, (name, value) in enumerate(kv_caches.items()):
        plain = layout is None and isinstance(value, torch.Tensor) and name not in specs and (
            every_value_size is None and name not in value_sizes)
        if plain:
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
            key, tensors = layer_key(value, layer_layout, specs.get(name), value_sizes.get(name, every_value_size))
        except LayerTypeError as error:
            type_errors.append(f"layer {index} {name!r}: {error}")
            continue
        except LayerValueError as error:
            value_errors.append(f"layer {index} {name!r}: {error}")
            continue
        device = tensors[0].device
        if first_device is None:
            first_device = device
        elif device != first_device:
            mixed_devices = True
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = ([], [])
        bucket[0].append(name)
        bucket[1].append(index)
        if plain:
            plain_buckets[(value.shape, value.dtype)] = bucket
    if type_errors:
        raise TypeError("bad KV caches: " + "; ".join(type_errors))
    if value_errors:
        raise KVGroupsError("bad KV caches: " + "; ".join(value_errors))
    if mixed_devices:
        raise KVGroupsError(f"KV caches must all be on one device, found {_devices(kv_caches)}")
    # dicts keep insertion order, so buckets are already ordered by their first layer index.
    return [(key, names, indices) for key, (names, indices) in buckets.items()]
