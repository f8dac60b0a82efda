"""The data path's GPU discipline as far as a CPU shows it: warm-up copies that change nothing, Triton
launches split under CUDA's grid limit, and completions that are done when a CPU copy returns."""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest
import torch

from kvgroups import KVLayerGroupsManager, KVLayout, RecurrentState
from kvgroups.datapath.buffers import ReadBuffers
from kvgroups.datapath.streams import DONE, CopyStream
from kvgroups.transfer import KVTransfer
from tests.support.helpers import Pending

KERNELS = [
    pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} missing"))
    if name != "torch" else name
    for name in ("numba", "triton", "torch")
]


def caches(generator: torch.Generator) -> tuple[dict[str, object], KVLayerGroupsManager]:
    values: dict[str, object] = {
        "attn.0": torch.randn(6, 2, 16, 64, generator=generator).to(torch.bfloat16),  # vLLM pages, K 40 / V 24
        "attn.1": torch.randn(6, 2, 16, 64, generator=generator).to(torch.bfloat16),
        "mamba.0": (torch.randn(3, 4, 5, generator=generator), torch.randn(3, 2, 8, generator=generator)),
    }
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups(values, {"mamba.0": RecurrentState(state_shapes=((4, 5), (2, 8)))},
                                  layout={"attn.0": KVLayout.VLLM, "attn.1": KVLayout.VLLM}, value_head_size={
                                      "attn.0": 24, "attn.1": 24})
    return values, manager


def snapshot(values: dict[str, object]) -> list[torch.Tensor]:
    tensors = [item for value in values.values() for item in (value if isinstance(value, tuple) else (value,))]
    return [tensor.clone().view(torch.uint8) for tensor in tensors if isinstance(tensor, torch.Tensor)]


@pytest.mark.parametrize("kernel", KERNELS)
def test_warm_up_compiles_by_copying_and_changes_no_byte(kernel: str) -> None:
    values, manager = caches(torch.Generator().manual_seed(0))
    before = snapshot(values)
    transfer = KVTransfer(manager, values, kernel=kernel)
    transfer.warm_up()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(values), before, strict=True))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton missing")
def test_triton_launches_more_runs_than_a_grid_holds_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgroups.datapath import run_queue, triton_copy  # triton loads on use

    monkeypatch.setattr(triton_copy, "MAX_GRID_RUNS", 7)  # CUDA's is 65,535: the same split, in fewer runs
    launched: list[tuple[str, tuple[int, int, int]]] = []

    def recorded(kernel: object, grid: tuple[int, int, int], arguments: tuple[object, ...],
                 constants: dict[str, object]) -> None:
        launched.append((kernel.__name__, grid))  # type: ignore[attr-defined]
        run_queue.launch(kernel, grid, arguments, constants)

    def recording(transfer: KVTransfer) -> KVTransfer:
        for copier in transfer._copiers:
            copier.launch = recorded  # type: ignore[union-attr]
        return transfer

    values, manager = caches(torch.Generator().manual_seed(1))
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(2))[:40]
    reference = KVTransfer(manager, values, kernel="torch").pack(slots, state_indices=[2, 0])
    split = recording(KVTransfer(manager, values, kernel="triton")).pack(slots, state_indices=[2, 0])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(split, reference, strict=True))
    # Keys and values (two tables) of two layers in one launch, 40 token runs in pieces of at most 7; the
    # state group's two layers' states (two tensors of one layer) in one.
    tokens = [("_copy_token_runs", (4, 7, 1))] * 5 + [("_copy_token_runs", (4, 5, 1))]
    assert launched == [*tokens, ("_copy_state_runs", (2, 2, 1))]
    targets, _ = caches(torch.Generator().manual_seed(3))
    expected, _ = caches(torch.Generator().manual_seed(3))
    recording(KVTransfer(manager, targets, kernel="triton")).unpack(split, slots, state_indices=[2, 0])
    KVTransfer(manager, expected, kernel="torch").unpack(reference, slots, state_indices=[2, 0])
    assert all(torch.equal(a, b) for a, b in zip(snapshot(targets), snapshot(expected), strict=True))


def test_on_the_cpu_a_copy_is_done_when_its_call_returns() -> None:
    stream = CopyStream(torch.device("cpu"))
    assert stream.stream is None
    with stream.launching(after_engine=True):
        done = stream.record()
    assert done is DONE and done.query()
    stream.before_engine(done)  # nothing to order on the CPU


def test_a_read_buffer_is_refilled_only_once_the_copy_out_of_it_completed() -> None:
    buffers = ReadBuffers(64, pin=False)
    first, array = buffers.take()
    assert array.dtype == np.uint8 and array.shape == (64,) and array.flags.writeable
    buffers.queued(first)
    assert not buffers.all_queued()
    second, _ = buffers.take()  # the other buffer: free at once
    assert second != first
    buffers.queued(second)
    assert buffers.all_queued()
    with pytest.raises(RuntimeError, match="launch them first"):
        buffers.take()  # the first buffer's entry is not copied yet
    copying = Pending()
    buffers.launched(copying)
    assert not buffers.all_queued()
    taken: list[int] = []
    waiter = threading.Thread(target=lambda: taken.append(buffers.take()[0]))
    waiter.start()
    waiter.join(0.2)
    assert taken == []  # the first buffer is still being copied from
    copying.done.set()
    waiter.join(10)
    assert taken == [first]
