"""The module functions' bindings, kept on the groups: ``pack`` / ``unpack`` on the same caches bind once.

Binding (checking every layer, building address tables and views) costs several times a small
copy, so :func:`bound_transfer` keeps the last binding (a
:class:`~kvgroups.datapath.transfer.KVTransfer`, which it is handed the means to build) on the
first group it was built for, with what it was built from: each group's identity and
edit version, the kernel asked for, and per layer tensor a weak reference and its address,
storage, offset, shape, strides and dtype. A call whose groups and tensors are all still those,
unchanged, reuses it; anything else (a group edited, a tensor replaced, resized, its storage
grown or ``set_`` to other memory, another kernel asked for) binds again. Nothing is
process-wide, and the binding never keeps a caller's caches alive: it holds views of them, and is
dropped as soon as a tensor it was built from goes.
"""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from kvgroups.core.group_keys import as_tensors
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.datapath.kernels import ENVIRONMENT_VARIABLE

Bound = TypeVar("Bound")

_ATTRIBUTE = "_kvgroups_transfer_binding"
# Per tensor of a layer's value: a weak reference, and its data_ptr, shape, strides and dtype.
_TensorRecord = tuple["weakref.ref[torch.Tensor]", int, torch.Size, tuple[int, ...], torch.dtype]


_data_ptr = torch.Tensor.data_ptr
_is_set_to = torch.Tensor.is_set_to
_version = operator.attrgetter("_version")


@dataclass(eq=False)
class _Binding:
    """What a binding was built from. Layers whose value is one tensor (most) are checked together,
    each property of all of them by one C-level pass (a few microseconds for 32 layers, where a loop
    over them took 30: the module functions' cost over a bound transfer); the others (tuples of
    state tensors, K/V pairs) one by one."""

    groups: tuple[tuple[int, int], ...]  # (id, version) of every group, in order
    kernel: str | None  # $KVGROUPS_KERNEL when bound
    layers: list[tuple[str, tuple[_TensorRecord, ...]]] = field(default_factory=list)
    transfer: Any = None
    # The one-tensor layers: their names, weak references and ids, data_ptr, and the aliases bound.
    names: tuple[str, ...] = ()
    references: tuple[weakref.ref[torch.Tensor], ...] = ()  # held: each one's callback drops the binding
    identities: tuple[int, ...] = ()
    pointers: tuple[int, ...] = ()
    aliases: tuple[torch.Tensor, ...] = ()  # on the same storage, offset, shape and strides as each was

    def seal(self, tensor_layers: set[str], aliases: Mapping[str, Any]) -> None:
        """Move the layers whose value is one tensor (``tensor_layers``) into the columns checked together;
        ``aliases``: what each layer was bound as (:func:`_alias`)."""
        simple = [(name, records[0]) for name, records in self.layers if name in tensor_layers]
        if simple:
            self.names = tuple(name for name, _ in simple)
            self.references = tuple(record[0] for _, record in simple)
            self.identities = tuple(id(reference()) for reference in self.references)
            self.pointers = tuple(record[1] for _, record in simple)
            self.aliases = tuple(aliases[name] for name in self.names)
        self.layers = [(name, records) for name, records in self.layers if name not in tensor_layers]

    def serves(self, groups: Sequence[KVLayerGroupInfo], kv_caches: Mapping[str, Any]) -> bool:
        if (self.kernel != os.environ.get(ENVIRONMENT_VARIABLE)
                or tuple(zip(map(id, groups), map(_version, groups), strict=True)) != self.groups):
            return False
        if self.names:
            try:
                values = operator.itemgetter(*self.names)(kv_caches)
            except (KeyError, TypeError):
                return False
            if len(self.names) == 1:
                values = (values,)
            # While the binding lives every tensor it was built from does (one going drops it): the same
            # ids are the same tensors, and their dtypes cannot have changed but with their storage.
            # is_set_to compares storage, offset, shape and strides in one call per tensor (a third
            # cheaper than reading shapes and strides into Python); data_ptr catches a storage resized
            # in place, which moves its memory under the same storage.
            if not (tuple(map(id, values)) == self.identities and tuple(map(_data_ptr, values)) == self.pointers
                    and all(map(_is_set_to, values, self.aliases))):
                return False
        for name, records in self.layers:
            value = kv_caches.get(name)
            tensors = (value,) if isinstance(value, torch.Tensor) else as_tensors(value)
            if tensors is None or len(tensors) != len(records):
                return False
            for tensor, (reference, pointer, shape, strides, dtype) in zip(tensors, records, strict=True):
                if (reference() is not tensor or tensor.data_ptr() != pointer or tensor.shape != shape
                        or tensor.stride() != strides or tensor.dtype != dtype):
                    return False
        return True


def _alias(value: Any) -> Any:
    """``value`` with every tensor replaced by another tensor on the same memory, which (unlike a view)
    does not hold the original tensor object, so that the caller dropping it is seen."""
    if isinstance(value, torch.Tensor):
        alias = torch.empty(0, dtype=value.dtype, device=value.device)
        return alias.set_(value.untyped_storage(), value.storage_offset(), value.shape, value.stride())
    if isinstance(value, (tuple, list)):
        return type(value)(_alias(item) for item in value)
    return value


def _drop(owner: weakref.ref[KVLayerGroupInfo], binding: weakref.ref[_Binding], _: object) -> None:
    """A tensor a binding was built from went: drop the binding (and the views it holds) at once."""
    group, held = owner(), binding()
    if group is not None and held is not None and getattr(group, _ATTRIBUTE, None) is held:
        object.__setattr__(group, _ATTRIBUTE, None)


def bound_transfer(groups: list[KVLayerGroupInfo], kv_caches: Mapping[str, Any],
                   bind: Callable[[list[KVLayerGroupInfo], Mapping[str, Any]], Bound]) -> Bound:
    """``bind(groups, kv_caches)``, or the binding kept on the groups when it still serves these caches."""
    if not groups or not isinstance(kv_caches, Mapping):
        return bind(groups, kv_caches)  # nothing to keep (or a bad argument, which bind names)
    owner = groups[0]
    kept: _Binding | None = getattr(owner, _ATTRIBUTE, None)
    if kept is not None and kept.transfer is not None and kept.serves(groups, kv_caches):
        transfer: Bound = kept.transfer
        return transfer
    names = [name for group in groups for name in group.layer_names]
    aliases = {name: _alias(kv_caches[name]) for name in names if name in kv_caches}
    transfer = bind(groups, aliases)
    binding = _Binding(groups=tuple((id(group), group._version) for group in groups),
                       kernel=os.environ.get(ENVIRONMENT_VARIABLE))
    drop = partial(_drop, weakref.ref(owner), weakref.ref(binding))
    for name in dict.fromkeys(names):
        value = kv_caches[name]
        binding.layers.append((name, tuple(
            (weakref.ref(tensor, drop), tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
            for tensor in ((value,) if isinstance(value, torch.Tensor) else as_tensors(value) or ()))))
    binding.seal({name for name in names if isinstance(kv_caches[name], torch.Tensor)}, aliases)
    binding.transfer = transfer
    object.__setattr__(owner, _ATTRIBUTE, binding)
    return transfer
