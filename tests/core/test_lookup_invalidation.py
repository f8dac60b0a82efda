"""Lookups see every edit of the seed-style lists, and an edit costs only the managers that hold the group."""

from __future__ import annotations

import copy
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvgroups import KVLayerGroupInfo, KVLayerGroupsManager
from kvgroups.core.manager import KVLayerGroupsManager as ManagerClass
from tests.support.helpers import meta


def built(count: int = 4, offset: int = 0) -> KVLayerGroupsManager:
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({
        f"layer_{offset + i}": meta(2, 4, 16, 2 if i % 2 else 4, 8) for i in range(count)
    })
    return manager


@pytest.fixture
def reindex_counts(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    counts: dict[int, int] = {}
    original = ManagerClass._reindex

    def counting(self: KVLayerGroupsManager) -> Any:
        counts[id(self)] = counts.get(id(self), 0) + 1
        return original(self)

    monkeypatch.setattr(ManagerClass, "_reindex", counting)
    return counts


def test_editing_one_managers_groups_costs_another_manager_no_reindex(reindex_counts: dict[int, int]) -> None:
    first, second = built(), built(offset=10)
    assert first.get_group_by_layer_idx(0) is not None and second.get_group_by_layer_idx(0) is not None
    before = dict(reindex_counts)
    first.kv_layer_groups[0].layer_indices.append(99)
    first.kv_layer_groups[1].layer_names.sort()
    first.kv_layer_groups.reverse()
    assert first.get_group_by_layer_idx(99) is first.kv_layer_groups[1]
    assert second.get_group_by_layer_name("layer_10") is second.kv_layer_groups[0]
    assert reindex_counts[id(second)] == before[id(second)]
    assert reindex_counts[id(first)] == before[id(first)] + 3  # one per edit, done when it is made


def test_lookups_without_edits_never_reindex(reindex_counts: dict[int, int]) -> None:
    manager = built()
    before = reindex_counts[id(manager)]
    for _ in range(100):
        manager.get_group_by_layer_idx(1)
        manager.get_group_by_layer_name("layer_2")
        manager.get_group_by_layer_idx(1000)
    assert reindex_counts[id(manager)] == before


# Every way the seed API lets a caller change a list in place: (which list, edit, layer index now found).
EDITS: list[tuple[str, Callable[[list[Any]], Any], int]] = [
    ("indices", lambda items: items.append(40), 40),
    ("indices", lambda items: items.extend([41]), 41),
    ("indices", lambda items: items.insert(0, 42), 42),
    ("indices", lambda items: items.__setitem__(0, 43), 43),
    ("indices", lambda items: items.__setitem__(slice(0, 1), [44]), 44),
    ("indices", lambda items: items.__iadd__([45]), 45),
    # list.append bypasses the tracking; the *= that follows must tell the owner on its own.
    ("indices", lambda items: (list.append(items, 46), items.__imul__(1)), 46),
    ("indices", lambda items: (list.append(items, 47), items.sort()), 47),
    ("indices", lambda items: (list.append(items, 48), items.reverse()), 48),
]
REMOVALS: list[Callable[[list[Any]], Any]] = [
    lambda items: items.remove(items[0]),
    lambda items: items.pop(),
    lambda items: items.pop(0),
    lambda items: items.__delitem__(0),
    lambda items: items.clear(),
]


@pytest.mark.parametrize(("_", "edit", "found"), EDITS)
def test_every_in_place_edit_of_layer_indices_is_seen(_: str, edit: Callable[[list[Any]], Any], found: int) -> None:
    manager = built()
    group = manager.kv_layer_groups[0]
    assert manager.get_group_by_layer_idx(found) is None and not group.contains_layer(found)
    edit(group.layer_indices)
    assert manager.get_group_by_layer_idx(found) is group and group.contains_layer(found)


@pytest.mark.parametrize("remove", REMOVALS)
def test_every_removal_from_a_groups_lists_is_seen(remove: Callable[[list[Any]], Any]) -> None:
    manager = built(count=2)
    group = manager.kv_layer_groups[0]
    assert group.layer_indices == [0] and group.layer_names == ["layer_0"]
    assert manager.get_group_by_layer_idx(0) is group and group.contains_layer_name("layer_0")
    remove(group.layer_indices)
    remove(group.layer_names)
    assert manager.get_group_by_layer_idx(0) is None and not group.contains_layer(0)
    assert manager.get_group_by_layer_name("layer_0") is None and not group.contains_layer_name("layer_0")


@pytest.mark.parametrize("remove", REMOVALS)
def test_every_removal_from_the_group_list_is_seen(remove: Callable[[list[Any]], Any]) -> None:
    manager = built(count=1)
    assert manager.get_group_by_layer_idx(0) is not None
    remove(manager.kv_layer_groups)
    assert manager.get_group_by_layer_idx(0) is None


def test_a_group_held_by_two_managers_tells_both() -> None:
    first = built()
    second = KVLayerGroupsManager(list(first.kv_layer_groups))
    group = first.kv_layer_groups[0]
    assert first.get_group_by_layer_idx(0) is group and second.get_group_by_layer_idx(0) is group
    group.layer_indices[0] = 77
    assert first.get_group_by_layer_idx(77) is group and second.get_group_by_layer_idx(77) is group
    assert first.get_group_by_layer_idx(0) is None and second.get_group_by_layer_idx(0) is None


def test_a_layer_an_edit_puts_in_two_groups_is_found_in_the_first_as_a_scan_would() -> None:
    manager = built()
    first, second = manager.kv_layer_groups
    first.layer_indices.append(1)  # layer 1 is second's too
    first.layer_names.append("layer_1")
    assert manager.get_group_by_layer_idx(1) is first
    assert manager.get_group_by_layer_name("layer_1") is first
    manager.kv_layer_groups.reverse()
    assert manager.get_group_by_layer_idx(1) is second and manager.get_group_by_layer_idx(0) is first
    assert manager.get_group_by_layer_name("layer_1") is second


def test_replacing_a_groups_fields_is_seen() -> None:
    manager = built()
    group = manager.kv_layer_groups[0]
    assert manager.get_group_by_layer_name("layer_0") is group
    group.layer_names = ["renamed", "layer_2"]
    assert manager.get_group_by_layer_name("renamed") is group
    assert manager.get_group_by_layer_name("layer_0") is None and group.contains_layer_name("renamed")
    assigned = [5, 6]
    group.layer_indices = assigned
    group.layer_indices.append(7)  # the group's list, tracked, not the caller's
    assert manager.get_group_by_layer_idx(7) is group


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda manager: pickle.loads(pickle.dumps(manager))])
def test_copies_track_their_own_edits(duplicate: Callable[[KVLayerGroupsManager], KVLayerGroupsManager]) -> None:
    original = built()
    assert original.get_group_by_layer_idx(0) is original.kv_layer_groups[0]
    twin = duplicate(original)
    assert twin == original and twin.kv_layer_groups[0] is not original.kv_layer_groups[0]
    assert twin.get_group_by_layer_idx(0) is twin.kv_layer_groups[0]
    twin.kv_layer_groups[0].layer_indices.append(50)
    twin.kv_layer_groups.append(KVLayerGroupInfo(["x"], [60], torch.Size([4, 16, 576]), torch.bfloat16))
    assert twin.get_group_by_layer_idx(50) is twin.kv_layer_groups[0]
    assert twin.get_group_by_layer_idx(60) is twin.kv_layer_groups[-1]
    assert original.get_group_by_layer_idx(50) is None and original.get_group_by_layer_idx(60) is None
    original.kv_layer_groups[1].layer_indices.append(70)
    assert original.get_group_by_layer_idx(70) is original.kv_layer_groups[1]
    assert twin.get_group_by_layer_idx(70) is None


def test_a_lookup_racing_an_edit_sees_the_old_or_the_new_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """While an edit re-indexes (slowly here), a reader holding the bound lookup still finds every
    layer that has a group before and after the edit: the index is updated in place, key by key."""
    manager = built(count=64)
    lookup = manager.get_group_by_layer_idx  # held across the edit, as hot loops hold it
    held_by = KVLayerGroupInfo._held_by

    def slow_held_by(self: KVLayerGroupInfo, owner: Any) -> None:
        time.sleep(0.002)
        held_by(self, owner)

    monkeypatch.setattr(KVLayerGroupInfo, "_held_by", slow_held_by)
    editing = threading.Event()
    missing: list[int] = []

    def read_while_editing() -> None:
        editing.wait()
        while editing.is_set():
            missing.extend(index for index in range(64) if lookup(index) is None)

    reader = threading.Thread(target=read_while_editing)
    reader.start()
    editing.set()
    manager.kv_layer_groups.reverse()  # every layer keeps its group; the index is rebuilt
    manager.kv_layer_groups[0].layer_indices.append(64)
    editing.clear()
    reader.join()
    assert missing == []
    assert lookup(64) is manager.kv_layer_groups[0]
