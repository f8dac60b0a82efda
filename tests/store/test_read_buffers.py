"""A read buffer is taken again only once nothing holds a view of it: a memoryview, a slice, a tensor."""

from __future__ import annotations

import gc

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups.store.backends.read_buffers import BufferPool


def test_a_buffer_is_used_again_once_every_view_of_it_is_gone() -> None:
    pool = BufferPool(max_bytes=1 << 20)
    first = pool.take(1000)
    view = memoryview(first.data).cast("B")[10:20]
    tensor = torch.frombuffer(memoryview(first.data).cast("B")[100:104], dtype=torch.uint8).view(torch.int8)[1:]
    address = first.ctypes.data
    del first
    held = pool.take(1000)
    assert held.ctypes.data != address  # a view and a tensor of the first still live
    del view
    assert pool.take(1000).ctypes.data != address  # the tensor still does
    del tensor
    gc.collect()
    again = pool.take(1000)
    assert again.ctypes.data == address  # nothing holds the first: its pages are used again
    assert pool.take(1000).ctypes.data not in (address, held.ctypes.data)  # both held: never handed out twice


def test_the_pool_keeps_at_most_its_budget() -> None:
    pool = BufferPool(max_bytes=4096)
    held = [pool.take(1024) for _ in range(8)]  # all held: four kept, four of their own
    assert pool.kept_bytes == 4096 and len({buffer.ctypes.data for buffer in held}) == 8
    del held
    big = pool.take(4096)  # free ones are forgotten to keep the budget
    assert pool.kept_bytes <= 4096 and big.nbytes == 4096


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.booleans()), max_size=30))
def test_no_buffer_is_handed_out_while_held(requests: list[tuple[int, bool]]) -> None:
    pool = BufferPool(max_bytes=16 << 10)
    held: dict[int, memoryview] = {}  # by address: views of buffers still in use
    for nbytes, keep in requests:
        buffer = pool.take(nbytes)
        assert buffer.nbytes >= nbytes and buffer.ctypes.data not in held
        view = memoryview(buffer.data).cast("B")
        address = buffer.ctypes.data
        del buffer
        if keep:
            held[address] = view
