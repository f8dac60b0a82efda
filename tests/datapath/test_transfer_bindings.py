"""The module functions ``pack`` / ``unpack`` keep their binding on the groups, and it is never stale.

Whatever happens to the caches between calls (a tensor replaced in the dict, ``set_`` to other
memory, resized, restrided, written in place, the dict rebuilt, a group edited, another kernel
forced), the module functions move what a transfer bound afresh moves, or raise what it raises.
"""

from __future__ import annotations

import importlib.util
import os
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups import KVGroupsError, KVLayerGroupsManager, RecurrentState
from kvgroups.datapath import bindings
from kvgroups.transfer import KVTransfer, pack, unpack

SHAPE = (2, 6, 16, 2, 8)  # FLASH_ATTN: [2, num_blocks, block_size, num_heads, head_size]
STATES = (5, 4, 3)  # a recurrent layer: [num_state_slots, ...state]
KERNELS = [name for name in ("numba", "torch") if name == "torch" or importlib.util.find_spec(name)]


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("KVGROUPS_KERNEL", request.param)
    yield request.param


def model(seed: int) -> tuple[dict[str, Any], KVLayerGroupsManager]:
    generator = torch.Generator().manual_seed(seed)
    caches: dict[str, Any] = {f"l{i}": torch.randn(SHAPE, generator=generator) for i in range(3)}
    caches["m"] = torch.randn(STATES, generator=generator)
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {"m": RecurrentState(state_shapes=((4, 3),))})
    return caches, manager


def binding_of(manager: KVLayerGroupsManager) -> Any:
    return getattr(manager.kv_layer_groups[0], bindings._ATTRIBUTE, None)


def fresh_result(manager: KVLayerGroupsManager, caches: dict[str, Any], slots: torch.Tensor,
                 states: list[int]) -> list[torch.Tensor] | type[BaseException]:
    try:
        return KVTransfer(manager, caches).pack(slots, state_indices=states)
    except (KVGroupsError, TypeError) as error:
        return type(error)


def module_result(manager: KVLayerGroupsManager, caches: dict[str, Any], slots: torch.Tensor,
                  states: list[int]) -> list[torch.Tensor] | type[BaseException]:
    try:
        return pack(manager, caches, slots, state_indices=states)
    except (KVGroupsError, TypeError) as error:
        return type(error)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def mutate(action: str, caches: dict[str, Any], manager: KVLayerGroupsManager, generator: torch.Generator) -> None:
    name = "l1"
    tensor = caches.get(name)
    if tensor is None and action in ("write in place", "set_ to other memory", "resize to another shape",
                                     "restride in place", "transpose in place", "add a dimension in place",
                                     "grow the storage in place", "assign .data"):
        return
    if action == "write in place":
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    elif action == "replace the tensor":
        caches[name] = torch.randn(SHAPE, generator=generator)
    elif action == "set_ to other memory":
        other = torch.randn(SHAPE, generator=generator)
        tensor.set_(other.untyped_storage(), 0, SHAPE, other.stride())
    elif action == "resize to another shape":
        tensor.resize_(2, 5, 16, 2, 8)
    elif action == "restride in place":
        flipped = torch.randn(SHAPE, generator=generator).transpose(3, 4).contiguous().transpose(3, 4)
        tensor.set_(flipped.untyped_storage(), 0, SHAPE, flipped.stride())
    elif action == "transpose in place":  # the same memory, another shape and strides
        tensor.transpose_(3, 4)
    elif action == "add a dimension in place":
        tensor.unsqueeze_(0)
    elif action == "grow the storage in place":  # the same storage, shape and strides, its memory moved
        storage = tensor.untyped_storage()
        storage.resize_(storage.nbytes() * 4)
    elif action == "assign .data":  # the same tensor object on another tensor's memory
        tensor.data = torch.randn(SHAPE, generator=generator)
    elif action == "rebuild the dict":
        caches.update(dict(caches))
    elif action == "drop a layer":
        caches.pop(name, None)
    elif action == "restore the layers":
        for index in range(3):
            if f"l{index}" not in caches or caches[f"l{index}"].shape != SHAPE:
                caches[f"l{index}"] = torch.randn(SHAPE, generator=generator)
    elif action == "edit a group":
        group = manager.kv_layer_groups[0]
        group.layer_names = list(reversed(group.layer_names))
        group.layer_indices = list(reversed(group.layer_indices))
    elif action == "replace the state":
        caches["m"] = torch.randn(STATES, generator=generator)


ACTIONS = ["write in place", "replace the tensor", "set_ to other memory", "resize to another shape",
           "restride in place", "transpose in place", "add a dimension in place", "grow the storage in place",
           "assign .data", "rebuild the dict",
           "drop a layer", "restore the layers", "edit a group", "replace the state", "nothing"]


def test_the_kept_binding_never_serves_changed_caches(kernel: str) -> None:
    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=8), st.integers(0, 2**16), st.data())
    def check(actions: list[str], seed: int, data: st.DataObject) -> None:
        caches, manager = model(seed)
        generator = torch.Generator().manual_seed(seed + 1)
        for action in actions:
            mutate(action, caches, manager, generator)
            slots = torch.tensor(data.draw(st.lists(st.integers(0, 6 * 16 - 1), min_size=1, max_size=20, unique=True)))
            states = [data.draw(st.integers(0, STATES[0] - 1))]
            assert same(module_result(manager, caches, slots, states), fresh_result(manager, caches, slots, states))

    check()


def test_repeated_calls_reuse_one_binding_and_unpack_writes_the_callers_tensors(kernel: str) -> None:
    caches, manager = model(0)
    slots = torch.arange(10, 30)
    chunks = pack(manager, caches, slots, state_indices=[1])
    kept = binding_of(manager)
    assert kept is not None
    unpack(manager, caches, chunks, torch.arange(40, 60), state_indices=[3])
    assert binding_of(manager) is kept  # the same caches: bound once
    again = KVTransfer(manager, caches).pack(torch.arange(40, 60), state_indices=[3])
    assert all(torch.equal(a, b) for a, b in zip(chunks, again, strict=True))
    monkeypatched = os.environ["KVGROUPS_KERNEL"]
    os.environ["KVGROUPS_KERNEL"] = "torch" if monkeypatched != "torch" else monkeypatched
    try:
        pack(manager, caches, slots, state_indices=[1])
        assert (binding_of(manager) is kept) == (monkeypatched == "torch")  # another kernel: bound again
    finally:
        os.environ["KVGROUPS_KERNEL"] = monkeypatched


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "requires_grad"])
def test_a_call_in_another_autograd_mode_keeps_the_binding_and_moves_the_same_bytes(kernel: str, mode: str) -> None:
    """What is not the caches' layout (the autograd mode of the call, a cache that now requires grad)
    never makes the module functions bind again, and they move what a fresh transfer moves."""
    caches, manager = model(2)
    slots = torch.arange(5, 25)
    expected = pack(manager, caches, slots, state_indices=[2])
    kept = binding_of(manager)
    if mode == "requires_grad":
        caches["l0"].requires_grad_(True)
        context: Any = torch.no_grad()
    else:
        context = getattr(torch, mode)()
    with context:
        chunks = pack(manager, caches, slots, state_indices=[2])
        unpack(manager, caches, chunks, torch.arange(50, 70), state_indices=[4])
    assert binding_of(manager) is kept
    assert all(torch.equal(a, b) for a, b in zip(chunks, expected, strict=True))
    with torch.no_grad():
        again = KVTransfer(manager, caches).pack(torch.arange(50, 70), state_indices=[4])
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True))


def test_the_binding_never_keeps_the_callers_caches_alive(kernel: str) -> None:
    caches, manager = model(1)
    pack(manager, caches, torch.arange(4), state_indices=[0])
    kept = binding_of(manager)
    assert kept is not None
    transfer = weakref.ref(kept.transfer)
    del caches, kept
    assert binding_of(manager) is None  # dropped as soon as the caller's tensors went (no cycle to wait for)
    assert transfer() is None  # and with it the binding's hold on their memory
