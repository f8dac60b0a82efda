"""pack/unpack against a slow reference written plainly here, for every layout and dtype."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups import (
    ChunkMismatchError,
    KVGroupsError,
    KVLayerGroupsManager,
    KVLayout,
    LMCacheMetadata,
    RecurrentState,
    SlidingWindow,
    SlotMappingError,
)
from kvgroups.transfer import KVTransfer, pack, unpack

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
KERNELS = [
    pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} missing"))
    if name != "torch" else name
    for name in ("numba", "triton", "torch")
]


@pytest.fixture(scope="module", params=KERNELS, autouse=True)
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test of this module runs once per kernel, forced as a user would force it."""
    previous = os.environ.get("KVGROUPS_KERNEL")
    os.environ["KVGROUPS_KERNEL"] = request.param
    yield request.param
    if previous is None:
        del os.environ["KVGROUPS_KERNEL"]
    else:
        os.environ["KVGROUPS_KERNEL"] = previous

def cpu_page_read(cache: torch.Tensor, kv: int, b: int, o: int) -> torch.Tensor:
    num_heads, block_size, width = cache.shape[1:]
    head_size = width // 2
    pages = cache[b].view(num_heads, 2, block_size * head_size)  # a view: each page is contiguous
    if kv == 0:
        return pages[:, 0].view(num_heads, head_size, block_size)[:, :, o]
    return pages[:, 1].view(num_heads, block_size, head_size)[:, o]


def amx_page_read(cache: torch.Tensor, kv: int, b: int, o: int) -> Any:
    """vLLM's amx reshape_and_cache, element by element: keys in groups of 16 tokens of 32-bit pairs,
    values in groups of 16 head elements with tokens in pairs (csrc/cpu/cpu_attn_amx.hpp)."""
    num_heads, block_size, width = cache.shape[1:]
    head_size = width // 2
    d = torch.arange(head_size)
    if kv == 0:
        places = (o // 16) * 16 * head_size + (d // 2) * 32 + (o % 16) * 2 + d % 2
    else:
        places = block_size * head_size + (d // 16) * 16 * block_size + (o // 2) * 32 + (d % 16) * 2 + o % 2
    pages = cache[b].view(num_heads, 2 * block_size * head_size)  # a view: each page is contiguous
    return _Places(pages, places)


class _Places:
    """A token's elements at scattered places of its pages: read as a tensor, written through copy_."""

    def __init__(self, pages: torch.Tensor, places: torch.Tensor) -> None:
        self.pages, self.places = pages, places
        self.shape = torch.Size([pages.shape[0], places.shape[0]])

    def reshape(self, *shape: int) -> torch.Tensor:
        return self.pages[:, self.places].reshape(*shape)

    def copy_(self, source: torch.Tensor) -> None:
        self.pages[:, self.places] = source.view(self.shape)


# token (block b, offset o) of plane kv -> its [num_heads, head_size] (MLA: [head_size]) elements,
# spelled out per layout, independently of kvgroups' axis tables.
READ: dict[KVLayout, Callable[[Any, int, int, int], torch.Tensor]] = {
    KVLayout.FLASH_ATTN: lambda cache, kv, b, o: cache[kv, b, o],
    KVLayout.FLASH_ATTN_HND: lambda cache, kv, b, o: cache[kv, b, :, o],
    KVLayout.FLASHINFER: lambda cache, kv, b, o: cache[b, kv, o],
    KVLayout.FLASHINFER_HND: lambda cache, kv, b, o: cache[b, kv, :, o],
    KVLayout.MLA: lambda cache, kv, b, o: cache[b, o],
    KVLayout.KV_SPLIT: lambda cache, kv, b, o: cache[kv][b, o],
    KVLayout.KV_SPLIT_HND: lambda cache, kv, b, o: cache[kv][b, :, o],
    # vLLM: the last axis of (block, head, token) is K then V.
    KVLayout.VLLM: lambda cache, kv, b, o: cache[b, :, o].unflatten(-1, (2, -1))[:, kv],
    # vLLM CPU: page (block, head) is K as [head_size, block_size], then V as [block_size, head_size].
    KVLayout.VLLM_CPU: cpu_page_read,
    KVLayout.VLLM_CPU_AMX: amx_page_read,
}



def served_by(kernel: str, layout: KVLayout) -> str:
    """The kernel a group of ``layout`` gets when ``kernel`` is forced: amx pages (CPU only, no token
    rows) have a numba kernel of their own and the torch path elsewhere."""
    return "torch" if layout is KVLayout.VLLM_CPU_AMX and kernel == "triton" else kernel


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


def make_cache(layout: KVLayout, nb: int, bs: int, nh: int, hs: int, dtype: torch.dtype, storage: str,
               generator: torch.Generator) -> Any:
    """One layer's cache; storage "permuted" builds HND layouts as views of NHD storage."""
    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        return random_tensor(shape, dtype, generator)

    if layout is KVLayout.FLASH_ATTN:
        return tensor((2, nb, bs, nh, hs))
    if layout is KVLayout.FLASHINFER:
        return tensor((nb, 2, bs, nh, hs))
    if layout is KVLayout.MLA:
        return tensor((nb, bs, hs))
    if layout is KVLayout.KV_SPLIT:
        return (tensor((nb, bs, nh, hs)), tensor((nb, bs, nh, hs)))
    permuted = storage == "permuted"
    if layout is KVLayout.VLLM:
        # permuted: vLLM's NHD (LBNHC) order, tokens outside heads in memory.
        return tensor((nb, bs, nh, 2 * hs)).permute(0, 2, 1, 3) if permuted else tensor((nb, nh, bs, 2 * hs))
    if layout.is_cpu_page:
        # permuted: heads outside blocks in memory; each page stays contiguous, as the backend needs.
        return tensor((nh, nb, bs, 2 * hs)).permute(1, 0, 2, 3) if permuted else tensor((nb, nh, bs, 2 * hs))
    if layout is KVLayout.FLASH_ATTN_HND:
        return tensor((2, nb, bs, nh, hs)).permute(0, 1, 3, 2, 4) if permuted else tensor((2, nb, nh, bs, hs))
    if layout is KVLayout.FLASHINFER_HND:
        return tensor((nb, 2, bs, nh, hs)).permute(0, 1, 3, 2, 4) if permuted else tensor((nb, 2, nh, bs, hs))
    assert layout is KVLayout.KV_SPLIT_HND
    if permuted:
        return (tensor((nb, bs, nh, hs)).permute(0, 2, 1, 3), tensor((nb, bs, nh, hs)).permute(0, 2, 1, 3))
    return (tensor((nb, nh, bs, hs)), tensor((nb, nh, bs, hs)))


def clone_cache(value: Any) -> Any:
    """A deep copy that keeps the strides (a permuted view stays a permuted view)."""
    if isinstance(value, tuple):
        return tuple(clone_cache(item) for item in value)
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    copy.copy_(value)
    return copy


def bits(value: Any) -> list[torch.Tensor]:
    tensors = list(value) if isinstance(value, tuple) else [value]
    return [tensor.contiguous().view(torch.uint8) for tensor in tensors]


def reference_pack(layout: KVLayout, caches: dict[str, Any], slots: list[int], bs: int, dtype: torch.dtype,
                   hidden: int) -> torch.Tensor:
    kv_size = 1 if layout is KVLayout.MLA else 2
    chunk = torch.empty(kv_size, len(caches), len(slots), hidden, dtype=dtype)
    for layer, cache in enumerate(caches.values()):
        for kv in range(kv_size):
            for token, slot in enumerate(slots):
                chunk[kv, layer, token] = READ[layout](cache, kv, slot // bs, slot % bs).reshape(-1)
    return chunk


def reference_unpack(layout: KVLayout, caches: dict[str, Any], chunk: torch.Tensor, slots: list[int], bs: int) -> None:
    for layer, cache in enumerate(caches.values()):
        for kv in range(chunk.shape[0]):
            for token, slot in enumerate(slots):
                target = READ[layout](cache, kv, slot // bs, slot % bs)
                target.copy_(chunk[kv, layer, token].view(target.shape))


@dataclass
class Case:
    layout: KVLayout
    dtype: torch.dtype
    nb: int
    bs: int
    nh: int
    hs: int
    num_layers: int
    storage: str
    slot_mode: str
    seed: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layout = draw(st.sampled_from([layout for layout in KVLayout if layout is not KVLayout.RECURRENT]))
    amx = layout is KVLayout.VLLM_CPU_AMX  # bfloat16 pages in groups of 16 tokens and 16 head elements
    return Case(
        layout=layout,
        dtype=draw(st.sampled_from((torch.bfloat16, torch.float16) if amx else DTYPES)),
        nb=draw(st.integers(2, 6)),
        bs=draw(st.sampled_from([16, 32] if amx else [1, 2, 4, 16])),
        nh=1 if layout is KVLayout.MLA else draw(st.sampled_from([1, 2, 3])),
        hs=draw(st.sampled_from([16, 32] if amx else [1, 4, 8])),
        num_layers=draw(st.integers(1, 3)),
        storage=draw(st.sampled_from(["contiguous", "permuted", "pool"])),
        slot_mode=draw(st.sampled_from(["block-aligned", "shuffled-blocks", "arbitrary", "range"])),
        seed=draw(st.integers(0, 2**16)),
    )


def build(case: Case) -> tuple[dict[str, Any], KVLayerGroupsManager]:
    generator = torch.Generator().manual_seed(case.seed)
    if case.storage == "pool" and case.layout in (KVLayout.FLASH_ATTN, KVLayout.FLASHINFER, KVLayout.MLA,
                                                  KVLayout.VLLM, KVLayout.VLLM_CPU, KVLayout.VLLM_CPU_AMX):
        # Layers as evenly spaced views of one buffer, as single-pool engines allocate them.
        one = make_cache(case.layout, case.nb, case.bs, case.nh, case.hs, case.dtype, "contiguous", generator)
        pool = random_tensor((case.num_layers, *one.shape), case.dtype, generator)
        caches: dict[str, Any] = {f"layers.{i}": pool[i] for i in range(case.num_layers)}
    else:
        caches = {
            f"layers.{i}": make_cache(case.layout, case.nb, case.bs, case.nh, case.hs, case.dtype, case.storage,
                                      generator)
            for i in range(case.num_layers)
        }
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, layout=case.layout)
    return caches, manager


def draw_slots(case: Case, data: st.DataObject) -> tuple[torch.Tensor, int, int | None]:
    capacity = case.nb * case.bs
    if case.slot_mode in ("block-aligned", "shuffled-blocks"):
        blocks = data.draw(st.permutations(list(range(case.nb))))
        if case.slot_mode == "block-aligned":
            blocks = sorted(blocks)
        count = data.draw(st.integers(1, case.nb))
        slots = [block * case.bs + offset for block in blocks[:count] for offset in range(case.bs)]
        extra = data.draw(st.integers(0, case.bs - 1))  # a partial block at the end
        spare = [s for s in range(capacity) if s not in set(slots)]
        slots += spare[:extra]
        return torch.tensor(slots, dtype=torch.int64), 0, None
    slots = data.draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=capacity, unique=True))
    mapping = torch.tensor(slots, dtype=torch.int64)
    if case.slot_mode == "range":
        start = data.draw(st.integers(0, len(slots)))
        end = data.draw(st.integers(start, len(slots)))
        return mapping, start, end
    return mapping, 0, None


def examples(kernel: str, count: int) -> int:
    """Hypothesis examples for a kernel: Triton's interpreter runs each launch in Python, so fewer."""
    return max(20, count // 8) if kernel == "triton" else count


def test_pack_matches_reference_and_unpack_restores_exactly(kernel: str) -> None:
    @settings(max_examples=examples(kernel, 300), deadline=None)
    @given(cases(), st.data())
    def check(case: Case, data: st.DataObject) -> None:
        pack_matches_reference_and_unpack_restores_exactly(case, data)

    check()


def pack_matches_reference_and_unpack_restores_exactly(case: Case, data: st.DataObject) -> None:
    caches, manager = build(case)
    slot_mapping, start, end = draw_slots(case, data)
    slots = slot_mapping[start:end].tolist()
    hidden = case.nh * case.hs
    (chunk,) = pack(manager, caches, slot_mapping, start=start, end=end)
    expected = reference_pack(case.layout, caches, slots, case.bs, case.dtype, hidden)
    assert chunk.shape == expected.shape and chunk.dtype == case.dtype
    assert torch.equal(chunk.view(torch.uint8), expected.view(torch.uint8))

    # Unpack into other caches of the same strides: packed slots take the chunk, the rest stay.
    generator = torch.Generator().manual_seed(case.seed + 1)
    targets = {
        name: tuple(t.copy_(random_tensor(t.shape, case.dtype, generator)) for t in clone_cache(value))
        if isinstance(value, tuple) else clone_cache(value).copy_(random_tensor(value.shape, case.dtype, generator))
        for name, value in caches.items()
    }
    want = {name: clone_cache(value) for name, value in targets.items()}
    reference_unpack(case.layout, want, expected, slots, case.bs)
    unpack(manager, targets, [chunk], slot_mapping, start=start, end=end)
    for name in caches:
        for got, wanted in zip(bits(targets[name]), bits(want[name]), strict=True):
            assert torch.equal(got, wanted), name


def test_out_buffers_are_filled_in_place_and_match_metadata_shapes() -> None:
    generator = torch.Generator().manual_seed(0)
    caches = {f"l{i}": random_tensor((2, 8, 16, 2, 4), torch.bfloat16, generator) for i in range(3)}
    caches["mla"] = random_tensor((8, 16, 12), torch.bfloat16, generator)
    metadata = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (4, 1, 64, 1, 12), use_mla=True, chunk_size=64)
    metadata.kv_layer_groups_manager.build_kv_layer_groups(caches)
    slots = torch.arange(16, 16 + 40)
    out = [torch.full(shape, 7.0, dtype=dtype) for shape, dtype in
           zip(metadata.get_shapes(40), metadata.get_dtypes(), strict=True)]
    result = pack(metadata.kv_layer_groups_manager, caches, slots, out=out)
    assert all(a is b for a, b in zip(result, out, strict=True))
    assert [tuple(t.shape) for t in result] == [(2, 3, 40, 8), (1, 1, 40, 12)]
    assert torch.equal(out[1][0, 0, 0], caches["mla"][1, 0])
    assert torch.equal(out[0][1, 2, 39], caches["l2"][1, (16 + 39) // 16, (16 + 39) % 16].reshape(-1))


def test_recurrent_state_moves_by_state_index() -> None:
    generator = torch.Generator().manual_seed(1)
    spec = RecurrentState(state_shapes=((6, 3), (2, 4, 5)))
    caches: dict[str, Any] = {
        "attn": random_tensor((2, 4, 16, 2, 8), torch.bfloat16, generator),
        "mamba0": (random_tensor((5, 6, 3), torch.bfloat16, generator),
                   random_tensor((5, 2, 4, 5), torch.bfloat16, generator)),
        "mamba1": (random_tensor((5, 6, 3), torch.bfloat16, generator),
                   random_tensor((5, 2, 4, 5), torch.bfloat16, generator)),
    }
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {"mamba0": spec, "mamba1": spec})
    states = [manager.kv_layer_groups[1]]
    assert states[0].layout is KVLayout.RECURRENT
    with pytest.raises(KVGroupsError, match=r"groups \[1\] hold recurrent state.*state_indices"):
        pack(manager, caches, torch.arange(16))
    chunks = pack(manager, caches, torch.arange(16), state_indices=[3, 0])
    assert chunks[1].shape == (1, 2, 2, 18 + 40)
    conv, ssm = caches["mamba1"]
    assert torch.equal(chunks[1][0, 1, 0], torch.cat([conv[3].flatten(), ssm[3].flatten()]))
    mamba0 = torch.cat([caches["mamba0"][0][0].flatten(), caches["mamba0"][1][0].flatten()])
    assert torch.equal(chunks[1][0, 0, 1], mamba0)
    target = {name: clone_cache(value) for name, value in caches.items()}
    for name in ("mamba0", "mamba1"):
        for state in target[name]:
            state.zero_()
    unpack(manager, target, chunks, torch.arange(16), state_indices=[4, 1])
    assert torch.equal(target["mamba1"][1][4], ssm[3]) and torch.equal(target["mamba1"][0][1], caches["mamba1"][0][0])
    assert not target["mamba1"][1][0].any()  # untouched slot
    with pytest.raises(SlotMappingError, match=r"state_indices \[5\] outside group 1's \[0, 5\)"):
        pack(manager, caches, torch.arange(16), state_indices=[5])
    with pytest.raises(SlotMappingError, match=r"repeat a slot"):
        unpack(manager, target, chunks, torch.arange(16), state_indices=[1, 1])


@pytest.fixture
def llama_like() -> tuple[dict[str, Any], KVLayerGroupsManager]:
    generator = torch.Generator().manual_seed(2)
    caches = {f"l{i}": random_tensor((2, 4, 16, 2, 8), torch.bfloat16, generator) for i in range(2)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    return caches, manager


def snapshot(caches: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in caches.items()}


def assert_unchanged(caches: dict[str, Any], before: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(caches[name], before[name]) for name in caches)


def test_out_of_range_slots_raise_before_anything_is_written(llama_like: Any) -> None:
    caches, manager = llama_like
    (chunk,) = pack(manager, caches, torch.arange(4))
    before = snapshot(caches)
    for bad in ([0, 1, 64, 2], [0, -1, 2, 3]):
        with pytest.raises(SlotMappingError, match=r"1 slot\(s\) outside group 0's \[0, 64\) \(4 blocks x 16\)"):
            unpack(manager, caches, [chunk], torch.tensor(bad))
        with pytest.raises(SlotMappingError, match=r"outside group 0"):
            pack(manager, caches, torch.tensor(bad))
    assert_unchanged(caches, before)


def test_duplicate_slots_in_unpack(llama_like: Any) -> None:
    caches, manager = llama_like
    (chunk,) = pack(manager, caches, torch.tensor([5, 5, 6, 7]))  # reading a slot twice is fine
    before = snapshot(caches)
    with pytest.raises(SlotMappingError, match=r"several tokens to slots \[5\]"):
        unpack(manager, caches, [chunk], torch.tensor([5, 5, 6, 7]))
    assert_unchanged(caches, before)


def test_mismatched_chunks_name_the_group(llama_like: Any) -> None:
    caches, manager = llama_like
    slots = torch.arange(4)
    before = snapshot(caches)
    with pytest.raises(ChunkMismatchError, match=r"chunk for group 0 is \[2, 2, 3, 16\].*needs \[2, 2, 4, 16\]"):
        unpack(manager, caches, [torch.zeros(2, 2, 3, 16, dtype=torch.bfloat16)], slots)
    with pytest.raises(ChunkMismatchError, match=r"chunk for group 0 is \[2, 2, 4, 16\] torch.float16.*torch.bfloat16"):
        unpack(manager, caches, [torch.zeros(2, 2, 4, 16, dtype=torch.float16)], slots)
    with pytest.raises(ChunkMismatchError, match=r"got 2 chunks for 1 groups"):
        unpack(manager, caches, [torch.zeros(2, 2, 4, 16, dtype=torch.bfloat16)] * 2, slots)
    with pytest.raises(ChunkMismatchError, match=r"out for group 0 must be contiguous"):
        pack(manager, caches, slots, out=[torch.zeros(2, 2, 16, 4, dtype=torch.bfloat16).transpose(2, 3)])
    with pytest.raises(ChunkMismatchError, match=r"out for group 0 is \[2, 2, 5, 16\]"):
        pack(manager, caches, slots, out=[torch.zeros(2, 2, 5, 16, dtype=torch.bfloat16)])
    assert_unchanged(caches, before)


def test_bad_slot_mapping_types_and_ranges(llama_like: Any) -> None:
    caches, manager = llama_like
    with pytest.raises(TypeError, match=r"1-D int64 tensor, got torch.int32"):
        pack(manager, caches, torch.arange(4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"must be an int64 tensor, got list"):
        pack(manager, caches, [0, 1])  # type: ignore[arg-type]
    with pytest.raises(SlotMappingError, match=r"start=3, end=2 must satisfy 0 <= start <= end <= 4"):
        pack(manager, caches, torch.arange(4), start=3, end=2)
    with pytest.raises(KVGroupsError, match=r"pass a slot_mapping"):
        pack(manager, caches)


def test_caches_that_do_not_match_the_groups(llama_like: Any) -> None:
    caches, manager = llama_like
    with pytest.raises(KVGroupsError, match=r"lacks layers the groups name: \['l1'\]"):
        pack(manager, {"l0": caches["l0"]}, torch.arange(4))
    wrong = dict(caches, l1=torch.zeros(2, 5, 16, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(KVGroupsError, match=r"layer 'l1' of group 0 is Tensor\[2, 5, 16, 2, 8\]"):
        pack(manager, wrong, torch.arange(4))


def test_empty_range_gives_empty_chunks(llama_like: Any) -> None:
    caches, manager = llama_like
    (chunk,) = pack(manager, caches, torch.arange(4), start=2, end=2)
    assert chunk.shape == (2, 2, 0, 16)
    unpack(manager, caches, [chunk], torch.arange(4), start=2, end=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_caches_with_pinned_cpu_chunks() -> None:
    generator = torch.Generator().manual_seed(3)
    host = {f"l{i}": random_tensor((2, 16, 16, 4, 32), torch.bfloat16, generator) for i in range(4)}
    caches = {name: tensor.cuda() for name, tensor in host.items()}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    slots = torch.randperm(256)[:100]
    out = [torch.empty(2, 4, 100, 128, dtype=torch.bfloat16).pin_memory()]
    pack(manager, caches, slots, out=out)
    (on_device,) = pack(manager, caches, slots.cuda())
    assert torch.equal(out[0], on_device.cpu())
    target = {name: torch.zeros_like(tensor) for name, tensor in caches.items()}
    unpack(manager, target, out, slots)
    (again,) = pack(manager, target, slots)
    assert torch.equal(again.cpu(), out[0])


def test_a_bound_transfer_serves_many_calls_like_the_module_functions() -> None:
    generator = torch.Generator().manual_seed(4)
    spec = RecurrentState(state_shapes=((6, 3),))
    caches: dict[str, Any] = {f"l{i}": random_tensor((2, 8, 16, 2, 8), torch.bfloat16, generator) for i in range(3)}
    caches["m"] = random_tensor((4, 6, 3), torch.bfloat16, generator)
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {"m": spec})
    bound = KVTransfer(manager, caches)
    for start in (0, 16, 40, 100):
        slots = torch.arange(start, start + 20)
        chunks = bound.pack(slots, state_indices=[start % 4])
        expected = pack(manager, caches, slots, state_indices=[start % 4])
        assert all(torch.equal(a, b) for a, b in zip(chunks, expected, strict=True))
        bound.unpack(chunks, torch.flip(slots, [0]), state_indices=[3 - start % 4])
        again = pack(manager, caches, torch.flip(slots, [0]), state_indices=[3 - start % 4])
        assert all(torch.equal(a, b) for a, b in zip(chunks, again, strict=True))


def test_binding_checks_every_layer_once_and_calls_check_only_their_arguments(llama_like: Any) -> None:
    caches, manager = llama_like
    with pytest.raises(KVGroupsError, match=r"layer 'l1' of group 0 is Tensor\[2, 5, 16, 2, 8\].*expects 1 tensor"):
        KVTransfer(manager, dict(caches, l1=torch.zeros(2, 5, 16, 2, 8, dtype=torch.bfloat16)))
    with pytest.raises(KVGroupsError, match=r"layer 'l1' is on meta, other layers on cpu"):
        KVTransfer(manager, dict(caches, l1=caches["l1"].to("meta")))
    bound = KVTransfer(manager, caches)
    before = snapshot(caches)
    with pytest.raises(SlotMappingError, match=r"outside group 0"):
        bound.unpack([torch.zeros(2, 2, 1, 16, dtype=torch.bfloat16)], torch.tensor([64]))
    with pytest.raises(ChunkMismatchError, match=r"chunk for group 0 is \[2, 2, 2, 16\]"):
        bound.unpack([torch.zeros(2, 2, 2, 16, dtype=torch.bfloat16)], torch.tensor([1]))
    assert_unchanged(caches, before)


def test_the_kernel_moves_the_same_bytes_as_the_torch_path(kernel: str) -> None:
    @settings(max_examples=examples(kernel, 150), deadline=None)
    @given(cases(), st.data())
    def check(case: Case, data: st.DataObject) -> None:
        kernel_moves_the_same_bytes_as_the_torch_path(kernel, case, data)

    check()


def kernel_moves_the_same_bytes_as_the_torch_path(kernel: str, case: Case, data: st.DataObject) -> None:
    caches, manager = build(case)
    slot_mapping, start, end = draw_slots(case, data)
    fast, reference = KVTransfer(manager, caches), KVTransfer(manager, caches, kernel="torch")
    assert fast.kernels == [served_by(kernel, case.layout)]
    assert reference.kernels == ["torch"]
    # The numba kernel's ways for scattered rows (one is measured fastest): two widths, and how many rows
    # ahead a gather asks for (a hint: any number moves the same bytes).
    wide, ahead = data.draw(st.booleans()), data.draw(st.sampled_from([0, 1, 3, 8, 16, 1000]))
    for copier in fast._copiers:
        copier.wide, copier.ahead = wide, ahead  # type: ignore[attr-defined]
    (chunk,) = fast.pack(slot_mapping, start=start, end=end)
    (expected,) = reference.pack(slot_mapping, start=start, end=end)
    assert torch.equal(chunk.view(torch.uint8), expected.view(torch.uint8))
    generator = torch.Generator().manual_seed(case.seed + 2)
    noise = random_tensor(tuple(chunk.shape), case.dtype, generator)
    targets = {name: clone_cache(value) for name, value in caches.items()}
    wanted = {name: clone_cache(value) for name, value in caches.items()}
    writer = KVTransfer(manager, targets)
    for copier in writer._copiers:
        copier.wide, copier.ahead = wide, ahead  # type: ignore[attr-defined]
    writer.unpack([noise], slot_mapping, start=start, end=end)
    KVTransfer(manager, wanted, kernel="torch").unpack([noise], slot_mapping, start=start, end=end)
    for name in caches:
        for got, want in zip(bits(targets[name]), bits(wanted[name]), strict=True):
            assert torch.equal(got, want), name


def test_the_forced_kernel_serves_every_group_it_can_describe(kernel: str) -> None:
    generator = torch.Generator().manual_seed(5)
    spec = RecurrentState(state_shapes=((6, 3), (2, 4)))
    pool = random_tensor((3, 2, 4, 16, 2, 8), torch.float16, generator)
    caches: dict[str, Any] = {f"p{i}": pool[i] for i in range(3)}
    caches.update({f"h{i}": random_tensor((4, 2, 16, 2, 8), torch.float16, generator).permute(0, 1, 3, 2, 4)
                   for i in range(2)})
    caches["m"] = (random_tensor((3, 6, 3), torch.float16, generator),
                   random_tensor((3, 2, 4), torch.float16, generator))
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {"m": spec},
                                  layout={"h0": KVLayout.FLASHINFER_HND, "h1": KVLayout.FLASHINFER_HND})
    assert KVTransfer(manager, caches).kernels == [kernel] * 3
    # A recurrent state whose slots are not contiguous cannot be addressed by a table: torch copies it.
    strided = dict(caches, m=(caches["m"][0].transpose(1, 2).contiguous().transpose(1, 2), caches["m"][1]))
    assert KVTransfer(manager, strided).kernels == [kernel, kernel, "torch"]
    slots = torch.arange(10, 40)
    expected = KVTransfer(manager, strided, kernel="torch").pack(slots, state_indices=[2, 0])
    got = KVTransfer(manager, strided).pack(slots, state_indices=[2, 0])
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_kernel_that_cannot_run_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = {"l0": torch.zeros(2, 4, 16, 2, 8)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    monkeypatch.setenv("KVGROUPS_KERNEL", "cuda-magic")
    with pytest.raises(KVGroupsError, match=r"unknown kernel 'cuda-magic' \(from KVGROUPS_KERNEL\); expected one"):
        KVTransfer(manager, caches)
    monkeypatch.setenv("KVGROUPS_KERNEL", "numba")
    meta_caches = {"l0": caches["l0"].to("meta")}
    with pytest.raises(KVGroupsError, match=r"kernel 'numba' was asked for but cannot run: .*CPU memory; .* on meta"):
        KVTransfer(manager, meta_caches)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KVGroupsError, match=r"kernel 'triton' was asked for .*set TRITON_INTERPRET=1"):
        KVTransfer(manager, caches, kernel="triton")
    monkeypatch.delenv("KVGROUPS_KERNEL")
    assert KVTransfer(manager, meta_caches).kernels == ["torch"]
    with pytest.raises(KVGroupsError, match=r"num_threads must be an int >= 1"):
        KVTransfer(manager, caches, num_threads=0)


def test_a_cache_reallocated_after_binding_is_caught(kernel: str) -> None:
    caches = {"l0": torch.zeros(2, 4, 16, 2, 8)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    bound = KVTransfer(manager, caches)
    if bound.kernels == ["torch"]:
        pytest.skip("the torch path copies through views, which follow the tensor")
    caches["l0"].set_(torch.zeros(2, 4, 16, 2, 8).untyped_storage(), 0, (2, 4, 16, 2, 8))
    with pytest.raises(KVGroupsError, match=r"reallocated .* bind again"):
        bound.pack(torch.arange(4))


def test_chunks_from_pack_are_never_reused_while_held(kernel: str) -> None:
    generator = torch.Generator().manual_seed(6)
    caches = {"l0": random_tensor((2, 8, 16, 2, 8), torch.float32, generator)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    bound, reference = KVTransfer(manager, caches), KVTransfer(manager, caches, kernel="torch")
    (first,) = bound.pack(torch.arange(0, 16))
    kept, first_memory = first.clone(), first.data_ptr()
    view = first[0]
    del first
    (second,) = bound.pack(torch.arange(16, 32))  # the first chunk's memory is still held by `view`
    assert second.data_ptr() != first_memory and torch.equal(view, kept[0])
    second_memory = second.data_ptr()
    del view, second
    (third,) = bound.pack(torch.arange(32, 48))  # both are free again: one of them serves
    assert third.data_ptr() in (first_memory, second_memory)
    assert torch.equal(third, reference.pack(torch.arange(32, 48))[0])
    del third
    held = [bound.pack(torch.arange(i * 16, i * 16 + 16))[0] for i in range(4)]
    assert len({chunk.data_ptr() for chunk in held}) == 4
    for index, chunk in enumerate(held):
        assert torch.equal(chunk, reference.pack(torch.arange(index * 16, index * 16 + 16))[0])


def test_large_call_paths_of_the_numba_kernel_move_the_same_bytes(kernel: str) -> None:
    """Streaming stores and threads start at a few MiB; with their thresholds at 0 tiny cases take them too."""
    if kernel != "numba":
        pytest.skip("numba's large-call paths")
    from kvgroups.datapath import numba_copy

    @settings(max_examples=80, deadline=None)
    @given(cases(), st.data())
    def check(case: Case, data: st.DataObject) -> None:
        kernel_moves_the_same_bytes_as_the_torch_path(kernel, case, data)

    saved = numba_copy.PARALLEL_MIN_BYTES, numba_copy.STREAMING_MIN_BYTES
    numba_copy.PARALLEL_MIN_BYTES = numba_copy.STREAMING_MIN_BYTES = 0
    try:
        check()
    finally:
        numba_copy.PARALLEL_MIN_BYTES, numba_copy.STREAMING_MIN_BYTES = saved


@pytest.mark.parametrize("layout", [KVLayout.VLLM, KVLayout.VLLM_CPU, KVLayout.VLLM_CPU_AMX])
@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_groups_overlaid_on_one_vllm_buffer_move_only_their_own_blocks(layout: KVLayout, order: str,
                                                                         kernel: str) -> None:
    """As vLLM allocates a hybrid model: one int8 buffer, every group's layers at the same addresses.

    A block id belongs to one group at a time, so copies of one group must touch only its blocks.
    """
    if layout.is_cpu_page and order == "LBNHC":
        pytest.skip("the CPU backend reads only head-major (LBHNC) pages")
    nb, nh, bs, hs, num_layers, dtype = 6, 2, 4, 8, 2, torch.bfloat16
    if layout is KVLayout.VLLM_CPU_AMX:
        bs, hs = 16, 16  # amx pages come in groups of 16 tokens and 16 head elements
    page_bytes = nh * bs * 2 * hs * dtype.itemsize

    def views(raw: torch.Tensor) -> list[torch.Tensor]:
        layers = raw.view(dtype).view(num_layers, -1)
        if order == "LBHNC":
            return [layer.view(nb, nh, bs, 2 * hs) for layer in layers]
        return [layer.view(nb, bs, nh, 2 * hs).permute(0, 2, 1, 3) for layer in layers]

    generator = torch.Generator().manual_seed(5)
    raw = random_tensor((num_layers * nb * page_bytes // 2,), dtype, generator).view(torch.int8)
    shared = views(raw)
    caches = {"sliding.0": shared[0], "full.1": shared[0], "sliding.2": shared[1], "full.3": shared[1]}
    assert caches["sliding.0"].data_ptr() == caches["full.1"].data_ptr()
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches, {"sliding.0": SlidingWindow(window_tokens=8),
                                           "sliding.2": SlidingWindow(window_tokens=8)}, layout=layout)
    sliding, full = manager.kv_layer_groups
    assert sliding.layer_names == ["sliding.0", "sliding.2"] and full.layer_names == ["full.1", "full.3"]
    assert KVTransfer(manager, caches).kernels == [served_by(kernel, layout)] * 2
    owned = {"sliding": [4, 1], "full": [2, 5, 3]}
    slots = {name: torch.tensor([b * bs + o for b in blocks for o in range(bs)]) for name, blocks in owned.items()}
    chunks = {
        "sliding": KVTransfer([sliding], caches).pack(slots["sliding"])[0],
        "full": KVTransfer([full], caches).pack(slots["full"])[0],
    }
    for name, group in (("sliding", sliding), ("full", full)):
        layers = {layer: caches[layer] for layer in group.layer_names}
        expected = reference_pack(layout, layers, slots[name].tolist(), bs, dtype, nh * hs)
        assert torch.equal(chunks[name].view(torch.uint8), expected.view(torch.uint8))

    target_raw = torch.zeros_like(raw)
    target = views(target_raw)
    target_caches = {"sliding.0": target[0], "full.1": target[0], "sliding.2": target[1], "full.3": target[1]}
    KVTransfer([sliding], target_caches).unpack([chunks["sliding"]], slots["sliding"])
    KVTransfer([full], target_caches).unpack([chunks["full"]], slots["full"])
    for layer in range(num_layers):
        for block in range(nb):
            got, want = target[layer][block], shared[layer][block]
            if block in owned["sliding"] + owned["full"]:
                assert torch.equal(got, want), (layer, block)
            else:
                assert not got.any(), (layer, block)  # blocks no group owns stay as they were


def test_scattered_rows_move_the_same_bytes_every_way_and_the_repr_says_which_was_measured(kernel: str) -> None:
    """Sixteen rows in lockstep or four, asking for rows ahead or not (the numba kernel measures which is
    fastest on this CPU when it binds): many scattered slots, long enough for a parallel, streaming call,
    moved alike by every way and the torch path."""
    if kernel != "numba":
        pytest.skip("the two widths are the numba kernel's; the other kernels' bytes are held by the property tests")
    generator = torch.Generator().manual_seed(11)
    caches = {f"l{i}": random_tensor((2, 256, 16, 4, 64), torch.bfloat16, generator) for i in range(4)}
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(caches)
    before = snapshot(caches)
    transfer, reference = KVTransfer(manager, caches, num_threads=2), KVTransfer(manager, caches, kernel="torch")
    assert_unchanged(caches, before)  # measuring the widths only reads the caches
    if kernel == "numba":
        way = r"(16|4) at a time(, (16|8) rows ahead asked for)?"
        assert re.fullmatch(rf"KVTransfer\(1 groups on cpu: full_attention x4: numba, scattered rows {way} \(measured: "
                            rf"[\d.]+ ms for 16 at a time, [\d.]+ ms for 4 at a time, [\d.]+ ms for 16 at a time, 16 "
                            rf"rows ahead asked for, [\d.]+ ms for 4 at a time, 8 rows ahead asked for\)\)",
                            repr(transfer)), repr(transfer)
    slots = torch.randperm(256 * 16, generator=generator)[:2048]  # 8 MiB: parallel, streaming stores
    (expected,) = reference.pack(slots)
    noise = random_tensor(tuple(expected.shape), torch.bfloat16, generator)
    wanted = {name: clone_cache(value) for name, value in caches.items()}
    KVTransfer(manager, wanted, kernel="torch").unpack([noise], slots)
    for wide, ahead in itertools.product((True, False), (0, 8, 16)):
        for copier in transfer._copiers:
            copier.wide, copier.ahead = wide, ahead  # type: ignore[attr-defined]
        (chunk,) = transfer.pack(slots)
        assert torch.equal(chunk.view(torch.uint8), expected.view(torch.uint8))
        targets = {name: clone_cache(value) for name, value in caches.items()}
        writer = KVTransfer(manager, targets, num_threads=2)
        for copier in writer._copiers:
            copier.wide, copier.ahead = wide, ahead  # type: ignore[attr-defined]
        writer.unpack([noise], slots)
        for name in caches:
            assert torch.equal(targets[name].view(torch.uint8), wanted[name].view(torch.uint8)), (wide, ahead, name)
