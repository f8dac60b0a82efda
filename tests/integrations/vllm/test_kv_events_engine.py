"""KV events end to end: vLLM engines (CPU build) publish over ZMQ, and a subscriber decodes them as a
KV-aware router does (msgspec, vLLM's ``KVEventBatch``).

gemma3 (sliding + full attention: two KV-cache groups) with vLLM's prefix cache on, so that vLLM's
own events for the blocks it computed (medium GPU) come beside the connector's for the blocks the
store holds (medium DISK: a file store).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from kvgroups.store import FileStore
from kvgroups.store.entries.codec import read_header
from tests.integrations.vllm.test_end_to_end import CHUNK, flip_a_byte, prompt, requests, run_engines
from tests.integrations.vllm.tiny_vllm_models import save_model

OFF = {"kvgroups": {"load": False, "save": False}}


class Router:
    """Subscribes to a vLLM server's KV events as llm-d's and Dynamo's indexers do (msgspec, KVEventBatch).

    It binds a loopback port and the engine's publisher connects to it (vLLM connects to an endpoint
    without a wildcard), so that nothing listens beyond this machine."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.events: list[Any] = []
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self.events.extend(self._decoder.decode(payload).events)

    def close(self) -> list[Any]:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        return self.events


def served(job: dict[str, Any], tmp_path: Path, name: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """The engine's phases, and every KV event a subscriber received meanwhile."""
    router = Router("tcp://127.0.0.1:0", "kv")
    results = run_engines({**job, "kv_events": {"endpoint": router.endpoint, "topic": "kv"}}, tmp_path, name,
                          multiprocess=False)
    return results, router.close()


def of(events: list[Any], kind: type, medium: str) -> list[Any]:
    return [event for event in events if isinstance(event, kind) and event.medium == medium]


def chunk_events(events: list[BlockStored], tokens: list[int], chunk: int) -> list[BlockStored]:
    """The events of ``tokens``' chunk ``chunk`` (every group's)."""
    return [event for event in events if event.token_ids == tokens[chunk * CHUNK:(chunk + 1) * CHUNK]]


def test_a_router_sees_what_the_store_holds_saved_loaded_and_removed(tmp_path: Path) -> None:
    model = str(save_model("gemma3", tmp_path / "gemma3"))
    store_dir = tmp_path / "kv"
    x, y = prompt(3), prompt(4)
    # The last phase steps the engine once more: what was written meanwhile is announced with a step.
    phases = [{"requests": requests(x)}, {"requests": requests(y)},
              {"requests": requests(prompt(9, 40)), "kv_transfer_params": OFF}]
    job = {"model": model, "prefix_caching": True, "store_dir": str(store_dir), "phases": phases,
           "connector": {"store": f"file://{store_dir}", "chunk_size": CHUNK}}
    results, first = served(job, tmp_path, "first")
    own = of(first, BlockStored, "GPU")  # vLLM's own events of the blocks it computed
    stored = of(first, BlockStored, "DISK")
    groups = sorted({event.group_idx for event in own})
    assert len(groups) == 2 and sorted({event.group_idx for event in stored}) == groups
    # vLLM's own hashes of the blocks it computed (its full-attention group announces every block; its
    # sliding group only those its window keeps: a block's hash is the same in every group).
    own_hashes = {hash_ for event in own for hash_ in event.block_hashes}
    for group in groups:
        # Per group, the 2 prompts x 4 chunks saved: vLLM's own hashes of those blocks, one per block, each once.
        ours = [hash_ for event in stored if event.group_idx == group for hash_ in event.block_hashes]
        assert len(ours) == len(set(ours)) == 2 * 4 * CHUNK // stored[0].block_size
        assert set(ours) <= own_hashes
        assert {(event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) for event in stored
                if event.group_idx == group} == {(event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
                                                 for event in own if event.group_idx == group}
    assert {event.kv_cache_spec_kind for event in stored} == {"sliding_window", "full_attention"}
    x_stored = [event for chunk in range(4) for event in chunk_events(stored, x, chunk)]
    assert len(x_stored) == 8  # 4 chunks x 2 groups

    # One of y's entries damaged: chunk 1 of the full-attention group (kvgroups group 1; a sliding window
    # would not read it). A second engine loads x (announced: it can serve it now, whoever stored it)
    # and finds y's entry corrupt (deleted, announced removed).
    store = FileStore(store_dir)
    y_entries = sorted(set(results[1]["store_keys"]) - set(results[0]["store_keys"]))
    damaged = next(key for key in y_entries
                   if (read_header(store.get(key) or b"")["__metadata__"]["chunk"], key[-3:]) == ("1", ".g1"))
    flip_a_byte(store_dir, damaged)
    results, second = served(job, tmp_path, "second")
    assert [phase["outputs"][0]["num_cached_tokens"] for phase in results[:2]] == [256, 0]  # y recomputed
    loaded = of(second, BlockStored, "DISK")
    # What the load read: the full group's 4 chunks, the sliding group's last (its window is 64 tokens).
    read = [event for event in x_stored if event.kv_cache_spec_kind == "full_attention"] + [
        event for event in chunk_events(stored, x, 3) if event.kv_cache_spec_kind == "sliding_window"]
    assert sorted((event.group_idx, tuple(event.block_hashes)) for chunk in range(4)
                  for event in chunk_events(loaded, x, chunk)) == sorted(
        (event.group_idx, tuple(event.block_hashes)) for event in read)
    (removed,) = of(second, BlockRemoved, "DISK")
    (y_chunk_1,) = [event for event in chunk_events(stored, y, 1) if event.kv_cache_spec_kind == "full_attention"]
    assert (removed.group_idx, removed.block_hashes) == (y_chunk_1.group_idx, y_chunk_1.block_hashes)
    # vLLM recomputed y and the connector saved it again: a router that applies the events in order
    # ends up with y's chunk stored, as the store has it.
    again = [index for index, event in enumerate(second) if isinstance(event, BlockStored) and event.medium == "DISK"
             and (event.group_idx, event.block_hashes) == (removed.group_idx, removed.block_hashes)]
    assert again and again[-1] > second.index(removed)
    read_header(store.get(damaged) or b"")  # a whole entry again
