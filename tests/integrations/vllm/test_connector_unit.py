"""The connector against vLLM's real Scheduler and fake worker caches laid out as vLLM lays them out.

Sliding + full attention groups overlaid on one buffer (as vLLM's hybrid allocator places them),
in the CPU backend's layout and in the GPU backends'; a mamba group at unit level. Each test
plays two engine lifetimes: one fills the store, a fresh scheduler and fresh caches reuse it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm

from kvgroups import KVLayerGroupsManager
from kvgroups.core.layouts import KVLayout
from kvgroups.datapath.transfer import pack, unpack
from kvgroups.errors import UnsupportedCacheError
from kvgroups.integrations.vllm.backends import check_backends
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.settings import ConnectorConfigError, ConnectorSettings, model_identity
from kvgroups.store import FileStore
from tests.integrations.vllm.harness import (
    CHUNK,
    DIFF_KEYS,
    DIFF_VALUES,
    DTYPE,
    ENGINE_LAYOUT,
    STATE_SHAPES,
    FakeWorker,
    SchedulerHarness,
    Step,
    cache_config,
    file_store,
    prompt,
    token_rows,
    vllm_config,
)
from tests.support.servers import running_server


def fill(model_dir: Path, extra: dict[str, Any], kinds: list[str], tokens: list[int], *,
         layout: KVLayout = ENGINE_LAYOUT, max_batched: int = 256, **cache: Any) -> tuple[FakeWorker, list[Step]]:
    kv = cache_config(kinds, **cache)
    config = vllm_config(model_dir, extra, max_batched=max_batched)
    worker = FakeWorker(config, kv, layout=layout, seed=0)
    harness = SchedulerHarness(config, kv)
    harness.add("fill", tokens)
    return worker, harness.run(worker)


def fresh(model_dir: Path, extra: dict[str, Any], kinds: list[str], *, layout: KVLayout = ENGINE_LAYOUT,
          **cache: Any) -> tuple[SchedulerHarness, FakeWorker]:
    kv = cache_config(kinds, **cache)
    config = vllm_config(model_dir, extra)
    return SchedulerHarness(config, kv), FakeWorker(config, kv, layout=layout, seed=1)


@pytest.fixture(params=[KVLayout.VLLM_CPU, KVLayout.VLLM], ids=lambda layout: layout.value)
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> KVLayout:
    """Both vLLM layouts; the scheduler side (whose Deployment vLLM builds) reads the same one,
    since the layout enters the fingerprint."""
    chosen: KVLayout = request.param
    monkeypatch.setattr("kvgroups.integrations.vllm.deployment.engine_layout", lambda is_cpu: chosen)
    return chosen


def test_a_fresh_engine_reuses_every_group_byte_for_byte(gemma3_dir: Path, tmp_path: Path, layout: KVLayout) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path)
    first, steps = fill(gemma3_dir, extra, ["sliding", "full"], tokens, layout=layout)
    (save,) = steps[0].metadata.saves
    assert save.chunks == (0, 1, 2) and save.step_end == 100  # the prompt in one step; 96 tokens in chunks
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"], layout=layout)
    harness.add("reuse", tokens)
    before = second.buffer.clone()
    steps, computed, load = harness.admit(second, "reuse")
    assert computed == 96  # never the last prompt token, in whole chunks
    assert (load.num_tokens, load.local_tokens, load.asynchronous) == (96, 0, True)
    # The load runs while the request waits, then the request is scheduled: two steps.
    assert len(steps) == 2 and steps[0].finished_loads == {"reuse"} and not steps[0].failed_loads
    assert not any(step.metadata.saves for step in steps)  # the loaded chunks are not written again
    sliding_ids, full_ids = load.block_ids
    assert sliding_ids[:4] == (0, 0, 0, 0) and 0 not in full_ids  # out of the 32-token window: null blocks
    # Each entry is read once, and only those the groups need: the sliding window's one chunk of 32
    # tokens and the full layers' three (1 KiB of K/V per token per group, plus each entry's header).
    assert second.side.store is not None
    sliding_bytes, full_bytes = second.side.store.stats.bytes_read
    assert 32 * 1024 < sliding_bytes < 33 * 1024 and 96 * 1024 < full_bytes < 99 * 1024
    # Full layers get all 96 tokens, sliding layers the blocks of their window; bytes exactly.
    got = token_rows(second, load.block_ids, range(96))
    want = token_rows(first, save.block_ids, range(96))
    window = [p for p in range(96) if sliding_ids[p // 16] != 0]
    assert window == list(range(64, 96))
    (got_sliding, got_full), (_, want_full) = got, want
    want_sliding = token_rows(first, save.block_ids, range(64, 96))[0]
    assert got_sliding.shape[2] == 32 and got_full.shape[2] == 96
    assert torch.equal(got_sliding.view(torch.uint8), want_sliding.view(torch.uint8))
    assert torch.equal(got_full.view(torch.uint8), want_full.view(torch.uint8))
    # Nothing outside the request's blocks was written: every byte that changed is in one of them.
    page = second.kv_cache_config.kv_cache_tensors[0].block_stride
    changed = (second.buffer != before).view(-1, page).any(dim=1).nonzero().flatten().tolist()
    num_blocks = second.kv_cache_config.num_blocks
    touched = {index % num_blocks for index in changed}
    assert touched <= {block for block in sliding_ids + full_ids if block}


def test_mla_latents_are_restored_byte_for_byte(gemma3_dir: Path, tmp_path: Path, layout: KVLayout) -> None:
    tokens = prompt(150)
    extra = file_store(tmp_path)
    first, steps = fill(gemma3_dir, extra, ["mla"], tokens, layout=layout)
    (save,) = steps[0].metadata.saves
    assert save.chunks == (0, 1, 2, 3)
    (group,) = first.deployment.groups
    assert (group.layout, group.layer_indices, group.hidden_dim_size) == (KVLayout.MLA, [0, 1], 128)
    assert first.deployment.metadata(0, first.deployment.groups, "worker").use_mla
    harness, second = fresh(gemma3_dir, extra, ["mla"], layout=layout)
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 128 and (load.num_tokens, load.local_tokens) == (128, 0)
    (got,), (want,) = token_rows(second, load.block_ids, range(128)), token_rows(first, save.block_ids, range(128))
    assert got.shape == (1, 2, 128, 128)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_with_vllms_prefix_cache_the_store_serves_what_follows_the_local_hit(gemma3_dir: Path,
                                                                              tmp_path: Path) -> None:
    tokens = prompt(150)
    extra = file_store(tmp_path)
    first, steps = fill(gemma3_dir, extra, ["full"], tokens)
    (save,) = steps[0].metadata.saves
    assert save.chunks == (0, 1, 2, 3)
    kv = cache_config(["full"])
    config = vllm_config(gemma3_dir, extra, prefix_caching=True)
    harness, second = SchedulerHarness(config, kv), FakeWorker(config, kv, seed=1)
    # A request that leaves its first 64 tokens in vLLM's own prefix cache, the store kept out of it.
    harness.add("warm", tokens[:70], kv_transfer_params={"kvgroups": {"load": False, "save": False}})
    (warm_step, *_) = harness.run(second)
    (warm,) = warm_step.output.scheduled_new_reqs
    local = token_rows(second, (tuple(warm.block_ids[0]),), range(64))
    harness.add("reuse", tokens)
    store = second.side.store
    assert store is not None
    read_before = sum(store.stats.bytes_read)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 128  # 64 from vLLM's cache, 64 from the store
    assert (load.num_tokens, load.local_tokens) == (128, 64)
    # Only the chunks past vLLM's own hit are read: 2 of 4 (1 KiB per token, plus the entries' headers).
    assert 64 * 1024 < sum(store.stats.bytes_read) - read_before < 66 * 1024
    (got,), (want,) = token_rows(second, load.block_ids, range(128)), token_rows(first, save.block_ids, range(128))
    assert torch.equal(got[:, :, 64:].view(torch.uint8), want[:, :, 64:].view(torch.uint8))
    # The locally cached tokens are vLLM's, left as they were (here they differ from the store's).
    assert torch.equal(got[:, :, :64].view(torch.uint8), local[0].view(torch.uint8))
    assert not torch.equal(got[:, :, :64], want[:, :, :64])


def flip_payload_bit(tmp_path: Path, key: str) -> None:
    path = Path(FileStore(f"{tmp_path}/kv")._path(key))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one flipped bit in the payload
    path.write_bytes(bytes(data))


def test_a_corrupt_entry_found_by_the_load_recomputes_the_request_once(gemma3_dir: Path, tmp_path: Path) -> None:
    """The scheduler promises a hit from existence alone; the worker finds the entry corrupt: the request
    is reported failed (two vLLM groups: request-level), recomputed from 0 without the store being
    offered again, and its recomputed chunks replace the deleted entry."""
    tokens = prompt(100)
    extra = file_store(tmp_path)
    first, _ = fill(gemma3_dir, extra, ["sliding", "full"], tokens)
    store = first.side.store
    assert store is not None
    full_group = first.side.engine_groups[1].members[0]
    corrupt_key = store.entry_key(store.keys(tokens)[2], full_group)
    flip_payload_bit(tmp_path, corrupt_key)
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
    harness.add("reuse", tokens)
    steps, computed, load = harness.admit(second, "reuse")
    assert load.num_tokens == 96 and load.asynchronous
    assert steps[0].finished_loads == steps[0].failed_loads == {"reuse"}
    assert computed == 0 and steps[-1].output.num_scheduled_tokens["reuse"] == 100
    assert second.side.store is not None and second.side.store.stats.corrupt_entries == 1
    assert (second.side.store.stats.short_loads, second.side.store.stats.loaded_tokens) == (1, 0)
    steps += harness.run(second)
    assert [plan.request_id for step in steps for plan in step.metadata.loads] == ["reuse"]  # never offered again
    assert not harness.scheduler.requests  # finished, its blocks freed
    assert FileStore(f"{tmp_path}/kv").contains(corrupt_key)  # saved again by the recompute


def test_a_synchronous_load_of_one_group_reports_its_blocks(gemma3_dir: Path, tmp_path: Path) -> None:
    """load_mode 'sync' on a model of one vLLM group: loaded before the forward of the step that schedules
    it; an entry gone by then reports the request's blocks and vLLM recomputes them."""
    tokens = prompt(100)
    extra = file_store(tmp_path, load_mode="sync")
    fill(gemma3_dir, extra, ["full"], tokens)
    harness, second = fresh(gemma3_dir, extra, ["full"])
    harness.add("served", tokens)
    steps, computed, load = harness.admit(second, "served")
    assert len(steps) == 1 and computed == 96 and not load.asynchronous and not steps[0].invalid_blocks
    harness.add("evicted", tokens)
    steps, computed, load = harness.admit(second, "evicted",
                                          before_load=lambda: FileStore(f"{tmp_path}/kv").clear())
    assert computed == 96 and not load.asynchronous
    (full_ids,) = load.block_ids
    assert steps[-1].invalid_blocks == set(full_ids[:6])
    request = harness.scheduler.requests["evicted"]
    assert request.num_computed_tokens == 0  # vLLM recomputes from the first failed block
    harness.run(second)
    assert not harness.scheduler.requests


def test_sync_mode_loads_a_model_of_several_groups_asynchronously(gemma3_dir: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """vLLM raises on block-level load errors of a model with several KV-cache groups: there, 'sync'
    falls back to asynchronous loads, whose failures are per request, and says so at start-up."""
    tokens = prompt(100)
    extra = file_store(tmp_path, load_mode="sync")
    fill(gemma3_dir, extra, ["sliding", "full"], tokens)
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
    assert ("load_mode 'sync' is not safe for this model (vLLM cannot recompute a failed synchronous load of "
            "2 KV-cache groups") in caplog.text
    harness.add("evicted", tokens)
    steps, computed, load = harness.admit(second, "evicted",
                                          before_load=lambda: FileStore(f"{tmp_path}/kv").clear())
    assert load.asynchronous and steps[0].failed_loads == {"evicted"} and not steps[0].invalid_blocks
    assert computed == 0
    harness.run(second)
    assert not harness.scheduler.requests


def test_other_salts_never_hit(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    fill(gemma3_dir, file_store(tmp_path, salt="tenant-a"), ["sliding", "full"], tokens)
    harness, second = fresh(gemma3_dir, file_store(tmp_path, salt="tenant-b"), ["sliding", "full"])
    harness.add("other-tenant", tokens)
    assert harness.admit(second, "other-tenant")[1] == 0
    harness, second = fresh(gemma3_dir, file_store(tmp_path, salt="tenant-a"), ["sliding", "full"])
    harness.add("other-cache-salt", tokens, cache_salt="user-7")
    harness.add("same", tokens)
    assert harness.admit(second, "other-cache-salt")[1] == 0
    assert harness.admit(second, "same")[1] == 96


def test_a_stopped_server_costs_misses_never_errors(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    with running_server(tmp_path) as server:
        extra = {"store": server.url, "chunk_size": CHUNK}
        fill(gemma3_dir, extra, ["sliding", "full"], tokens)
        harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
        harness.add("served", tokens)
        assert harness.admit(second, "served")[1] == 96
        server.stop()
        harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
        harness.add("down", tokens)
        _, computed, load = harness.admit(second, "down")
        assert computed == 0 and load is None


def test_entries_gone_between_lookup_and_load_recompute_the_request(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path)
    fill(gemma3_dir, extra, ["sliding", "full"], tokens)
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
    harness.add("reuse", tokens)
    # Another process evicts everything after the lookup, before the worker reads.
    steps, computed, _ = harness.admit(second, "reuse", before_load=lambda: FileStore(f"{tmp_path}/kv").clear())
    assert steps[0].failed_loads == {"reuse"} and computed == 0
    assert second.side.finished_loads() == (set(), set())  # reported once


def test_chunked_prefill_saves_each_chunk_in_the_step_that_completes_it(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path)
    _, steps = fill(gemma3_dir, extra, ["sliding", "full"], tokens, max_batched=CHUNK)
    assert [save.chunks for step in steps for save in step.metadata.saves] == [(0,), (1,), (2,)]
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
    harness.add("reuse", tokens)
    assert harness.admit(second, "reuse")[1] == 96


def write_states(worker: FakeWorker, block_ids: tuple[tuple[int, ...], ...], value: int) -> None:
    """Stand in for a mamba mixer: its state block now says how many tokens it has seen."""
    for engine_group in worker.side.engine_groups:
        if engine_group.token_indexed:
            continue
        for name in engine_group.layer_names:
            worker.caches[name][block_ids[engine_group.index][0]].fill_(value)


def test_mamba_states_are_saved_at_step_ends_on_chunk_boundaries_and_restored(gemma3_dir: Path,
                                                                             tmp_path: Path) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path)
    kv = cache_config(["mamba", "full"])
    config = vllm_config(gemma3_dir, extra, max_batched=CHUNK)
    first = FakeWorker(config, kv)
    harness = SchedulerHarness(config, kv)
    harness.add("fill", tokens)
    while harness.scheduler.has_unfinished_requests():
        step = harness.step()
        for save in step.metadata.saves:
            write_states(first, save.block_ids, save.step_end % 128)  # the state after this step
        first.side.save(step.metadata)
    first.side.flush()
    harness, second = fresh(gemma3_dir, extra, ["mamba", "full"])
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 96
    state_block = load.block_ids[0][0]
    content = sum(torch.Size(shape).numel() for shape in STATE_SHAPES) * DTYPE.itemsize
    for name in second.side.engine_groups[0].layer_names:
        page = second.caches[name][state_block].flatten()
        assert (page[:content] == 96).all()  # the state at 96 tokens, not at 64 or 100


def test_mamba_states_need_a_step_to_end_on_the_boundary(gemma3_dir: Path, tmp_path: Path) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path)
    fill(gemma3_dir, extra, ["mamba", "full"], tokens)  # one 100-token step: no state at any boundary
    harness, _ = fresh(gemma3_dir, extra, ["mamba", "full"])
    harness.add("reuse", tokens)
    assert harness.step().output.scheduled_new_reqs[0].num_computed_tokens == 0


def test_bad_settings_are_named(gemma3_dir: Path, tmp_path: Path) -> None:
    kv = cache_config(["sliding", "full"])
    with pytest.raises(ConnectorConfigError, match=r"chunk_size 40 must be a multiple .*group 0: 16, group 1: 16\)"
                                                   r".*the smallest chunk_size at least as large that works is 48"):
        Deployment(vllm_config(gemma3_dir, {"store": f"file://{tmp_path}", "chunk_size": 40}), kv)
    with pytest.raises(ConnectorConfigError, match=r"'chunk_size' must be an int >= 1, got 0"):
        Deployment(vllm_config(gemma3_dir, {"store": f"file://{tmp_path}", "chunk_size": 0}), kv)
    with pytest.raises(ConnectorConfigError, match=r"unknown keys \['chunk'\].*lives in one process"):
        Deployment(vllm_config(gemma3_dir, {"store": "memory://", "chunk": 32}), kv)


@pytest.mark.parametrize(("block_sizes", "chunk_size"), [
    ((16,), 256), ((384,), 384), ((528,), 528), ((96, 16), 288), ((100,), 300),
])
def test_without_a_chunk_size_chunks_follow_the_block_sizes_vllm_picked(
        gemma3_dir: Path, tmp_path: Path, block_sizes: tuple[int, ...], chunk_size: int) -> None:
    """A hybrid's attention block size is vLLM's choice at start-up (528 tokens for Qwen3.5 on GPUs, 384
    for a tiny qwen3-next-like model on this CPU): without "chunk_size" a chunk is the smallest multiple of
    every group's block size that holds at least 256 tokens."""
    settings = ConnectorSettings.from_extra_config({"store": f"file://{tmp_path}/kv"})
    assert settings.for_blocks(dict(enumerate(block_sizes))).chunk_size == chunk_size
    if len(block_sizes) == 1:
        kv = cache_config(["full"], block_size=block_sizes[0])
        deployment = Deployment(vllm_config(gemma3_dir, {"store": f"file://{tmp_path}/kv"}), kv)
        assert deployment.settings.chunk_size == chunk_size
        assert deployment.metadata(0, deployment.groups, "scheduler").chunk_size == chunk_size


def test_a_request_can_opt_out_of_loading_or_saving(gemma3_dir: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path)
    fill(gemma3_dir, extra, ["sliding", "full"], tokens)
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
    harness.add("no-load", tokens, kv_transfer_params={"kvgroups": {"load": False}})
    harness.add("no-save", prompt(100, seed=9), kv_transfer_params={"kvgroups": {"save": False}})
    harness.add("bad-options", tokens, kv_transfer_params={"kvgroups": {"load": "no"}})
    steps = harness.run(second)
    admitted = {request_id: computed for step in steps for request_id, computed in step.new().items()}
    assert admitted == {"no-load": 0, "no-save": 0, "bad-options": 96}
    assert {save.request_id for step in steps for save in step.metadata.saves} == {"no-load"}
    assert "must be {'load': bool, 'save': bool}" in caplog.text


def test_the_model_identity_follows_the_weights_not_their_path(gemma3_dir: Path, tmp_path: Path) -> None:
    # Another node's copy: another parent directory, fresh modification times, the same bytes.
    copy = Path(shutil.copytree(gemma3_dir, tmp_path / "node-2" / gemma3_dir.name, copy_function=shutil.copyfile))
    extra = file_store(tmp_path)
    original = model_identity(vllm_config(gemma3_dir, extra))
    assert model_identity(vllm_config(copy, extra)) == original
    version = ".".join(vllm.__version__.split(".")[:2])  # 0.32 (the CPU build), 0.33 or 0.34
    assert original.startswith(f"{gemma3_dir.name}|weights-") and original.endswith(
        f"|vllm-{version}|torch.float32|quantization-none")
    # A fine-tune written over the copy: same names and sizes, other bytes.
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(255 - byte for byte in data[header:])
    weights.write_bytes(bytes(data))
    assert model_identity(vllm_config(copy, extra)) != original


def test_mla_latents_are_saved_by_rank_0_alone_and_loaded_by_every_rank(gemma3_dir: Path, tmp_path: Path,
                                                                        layout: KVLayout) -> None:
    """vLLM replicates MLA latents on every tensor-parallel rank: rank 0 stores them once, under its keys, and
    every rank loads them from there; what ranks hold apart (full attention) each rank stores and loads."""
    tokens, extra, kinds = prompt(150), file_store(tmp_path), ["mla", "full"]
    kv = cache_config(kinds)
    config = vllm_config(gemma3_dir, extra, tp=2)
    fillers = tuple(FakeWorker(config, kv, layout=layout, seed=seed, rank=rank) for rank, seed in ((0, 0), (1, 5)))
    filler = SchedulerHarness(config, kv)
    filler.add("fill", tokens)
    (save,) = filler.run(fillers)[0].metadata.saves
    deployment = fillers[0].deployment
    assert deployment.shared_groups == {0} and deployment.owned_groups(1) == [1]
    rank_stores = filler.connector._scheduler.rank_stores
    keys = [store.keys(tokens[:128]) for store in rank_stores]
    assert [store.locate(None, keys=rank_keys, groups=[0]).num_tokens for store, rank_keys in zip(
        rank_stores, keys, strict=True)] == [128, 0]  # the latents: rank 0's entries only
    assert [store.locate(None, keys=rank_keys, groups=[1]).num_tokens for store, rank_keys in zip(
        rank_stores, keys, strict=True)] == [128, 128]
    harness = SchedulerHarness(config, kv)
    workers = tuple(FakeWorker(config, kv, layout=layout, seed=seed, rank=rank) for rank, seed in ((0, 1), (1, 2)))
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(workers, "reuse")
    assert computed == 128 and load.num_tokens == 128
    for worker, filled in zip(workers, fillers, strict=True):
        (got_mla, got_full) = token_rows(worker, load.block_ids, range(128))
        (_, want_full) = token_rows(filled, save.block_ids, range(128))
        (want_mla, _) = token_rows(fillers[0], save.block_ids, range(128))  # every rank: rank 0's latents
        assert torch.equal(got_mla.view(torch.uint8), want_mla.view(torch.uint8))
        assert torch.equal(got_full.view(torch.uint8), want_full.view(torch.uint8))


def test_diff_kv_pages_are_restored_byte_for_byte(gemma3_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's diff-KV pages (MiMo-V2): ``[num_blocks, heads, block_size, head_size + head_size_v]``, K rows of
    40 then V rows of 24 per (block, head, token), sliding and full groups, moved and stored unpadded."""
    monkeypatch.setattr("kvgroups.integrations.vllm.deployment.engine_layout", lambda is_cpu: KVLayout.VLLM)
    tokens, extra, kinds = prompt(100), file_store(tmp_path), ["diffkv_sliding", "diffkv_full"]
    first, steps = fill(gemma3_dir, extra, kinds, tokens, layout=KVLayout.VLLM)
    (save,) = steps[0].metadata.saves
    assert [(group.head_size, group.value_head_size, group.chunk_shape(CHUNK)) for group in first.deployment.groups] \
        == [(DIFF_KEYS, DIFF_VALUES, torch.Size([1, 2, CHUNK, 2 * (DIFF_KEYS + DIFF_VALUES)]))] * 2
    harness, second = fresh(gemma3_dir, extra, kinds, layout=KVLayout.VLLM)
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 96 and (load.num_tokens, load.local_tokens) == (96, 0)
    # Entries hold no padding: 2 layers x 2 heads x (40 + 24) float32 per token, plus each entry's header.
    assert second.side.store is not None
    sliding_bytes, full_bytes = second.side.store.stats.bytes_read
    assert 32 * 1024 < sliding_bytes < 33 * 1024 and 96 * 1024 < full_bytes < 99 * 1024
    # Read the pages directly, K and V parts alike: the second engine's blocks hold the first one's bytes.
    for group, (old_ids, new_ids) in enumerate(zip(save.block_ids, load.block_ids, strict=True)):
        positions = range(64, 96) if group == 0 else range(96)
        for name in harness.kv_cache_config.kv_cache_groups[group].layer_names:
            old = torch.stack([first.caches[name][old_ids[p // 16], :, p % 16] for p in positions])
            new = torch.stack([second.caches[name][new_ids[p // 16], :, p % 16] for p in positions])
            assert new.shape == (len(positions), 2, DIFF_KEYS + DIFF_VALUES)
            assert torch.equal(new.view(torch.uint8), old.view(torch.uint8))


def test_amx_pages_are_planned_where_vllm_picks_its_amx_kernels_and_restored_byte_for_byte(
        gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AMX, vLLM packs bfloat16 pages of block sizes that are a multiple of 32 for its
    amx kernels: both sides plan vllm_cpu_amx, check_backends takes 'amx' there and nothing else, and
    a fresh engine's pages hold the first one's bytes (whole pages: tile-packed, not token rows)."""
    monkeypatch.setattr("tests.integrations.vllm.harness.DTYPE", torch.bfloat16)
    monkeypatch.setattr("kvgroups.integrations.vllm.deployment.engine_layout", lambda is_cpu: KVLayout.VLLM_CPU)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    tokens, extra, kinds = prompt(100), file_store(tmp_path), ["sliding", "full"]

    def engine(seed: int) -> tuple[SchedulerHarness, FakeWorker]:
        kv = cache_config(kinds, block_size=32)
        config = vllm_config(gemma3_dir, extra, block_size=32)
        return SchedulerHarness(config, kv), FakeWorker(config, kv, layout=KVLayout.VLLM_CPU, seed=seed)

    harness, first = engine(0)
    assert {group.layout for group in first.deployment.groups} == {KVLayout.VLLM_CPU_AMX}
    names = list(first.deployment.plan.layers)
    check_backends(first.deployment.plan, dict.fromkeys(names, SimpleNamespace(
        attn_backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"), isa="amx")))
    with pytest.raises(UnsupportedCacheError, match=r"kernels 'vec' for torch.bfloat16 pages planned as vllm_cpu_amx"):
        check_backends(first.deployment.plan, dict.fromkeys(names, SimpleNamespace(
            attn_backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"), isa="vec")))
    harness.add("fill", tokens)
    (save,) = harness.run(first)[0].metadata.saves
    harness, second = engine(1)
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 96 and (load.num_tokens, load.local_tokens) == (96, 0)
    for group, (old_ids, new_ids) in enumerate(zip(save.block_ids, load.block_ids, strict=True)):
        blocks = range(2, 3) if group == 0 else range(3)  # the sliding window keeps the last block of 32
        for name in harness.kv_cache_config.kv_cache_groups[group].layer_names:
            for block in blocks:
                old, new = first.caches[name][old_ids[block]], second.caches[name][new_ids[block]]
                assert torch.equal(new.view(torch.uint8), old.view(torch.uint8)), (name, block)


def test_after_a_prefix_cache_reset_nothing_stored_before_is_served(gemma3_dir: Path, tmp_path: Path) -> None:
    """After a weight update vLLM calls reset_prefix_cache(reset_connector=True): what the store holds may
    come from the old weights, so the server never serves it again; what it stores after is served."""
    tokens, extra = prompt(100), file_store(tmp_path)
    fill(gemma3_dir, extra, ["sliding", "full"], tokens)
    harness, worker = fresh(gemma3_dir, extra, ["sliding", "full"])
    harness.add("before", tokens)
    assert harness.admit(worker, "before")[1] == 96
    harness.run(worker)
    assert harness.scheduler.reset_prefix_cache(reset_connector=True)
    harness.add("after", tokens)
    assert harness.admit(worker, "after")[1] == 0  # computed, and saved under the new keys
    harness.run(worker)
    harness.add("again", tokens)
    assert harness.admit(worker, "again")[1] == 96
    other, stranger = fresh(gemma3_dir, extra, ["sliding", "full"])  # another server: the old keys still
    other.add("elsewhere", tokens)
    assert other.admit(stranger, "elsewhere")[1] == 96


def test_diff_kv_pages_are_refused_where_no_backend_writes_them(gemma3_dir: Path, tmp_path: Path) -> None:
    config = vllm_config(gemma3_dir, file_store(tmp_path))
    refused = (r"layer 'model.layers.0.attn' \(FullAttentionSpec\): values of 24 elements per head differ from keys of "
               r"40, and layout vllm_cpu has no such pages")
    with pytest.raises(UnsupportedCacheError, match=refused):
        Deployment(config, cache_config(["diffkv_full"]), layout=KVLayout.VLLM_CPU)
    gpu = Deployment(config, cache_config(["diffkv_full"]), layout=KVLayout.VLLM)
    names = list(gpu.plan.layers)
    for backend in ("FLASH_ATTN_DIFFKV", "TRITON_ATTN_DIFFKV"):
        check_backends(gpu.plan, dict.fromkeys(names, SimpleNamespace(attn_backend=SimpleNamespace(
            get_name=lambda backend=backend: backend))))
    unknown = (r"model.layers.0.attn: backend FLASH_ATTN for values of another head size than keys \(known: "
               r"FLASH_ATTN_DIFFKV, TRITON_ATTN_DIFFKV\)")
    with pytest.raises(UnsupportedCacheError, match=unknown):
        check_backends(gpu.plan, dict.fromkeys(names, SimpleNamespace(attn_backend=SimpleNamespace(
            get_name=lambda: "FLASH_ATTN"))))


def test_backends_whose_pages_are_not_checked_are_refused(gemma3_dir: Path, tmp_path: Path) -> None:
    def layers(names: list[str], backend: str, isa: str | None = None) -> dict[str, Any]:
        found = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend), isa=isa)
        return dict.fromkeys(names, found)

    config = vllm_config(gemma3_dir, file_store(tmp_path))
    for layout in (KVLayout.VLLM_CPU, KVLayout.VLLM):
        full = Deployment(config, cache_config(["full"]), layout=layout)
        mla = Deployment(config, cache_config(["mla"]), layout=layout)
        names = list(full.plan.layers)
        check_backends(full.plan, layers(names, "CPU_ATTN", "vec") if layout is KVLayout.VLLM_CPU
                       else layers(names, "FLASH_ATTN"))
        check_backends(mla.plan, layers(names, "FLASHMLA"))
        # vLLM's CPU MLA prefill cannot continue from cached context (vLLM turns prefix caching off).
        with pytest.raises(UnsupportedCacheError, match=r"model.layers.0.attn: MLA backend CPU_MLA \(known: "):
            check_backends(mla.plan, layers(names, "CPU_MLA"))
    cpu = Deployment(config, cache_config(["full"]), layout=KVLayout.VLLM_CPU)
    refused = (r"backend CPU_ATTN, kernels 'amx' for torch.float32 pages planned as vllm_cpu \(checked: CPU_ATTN "
               r"with vec, vec16 for vllm_cpu; amx for vllm_cpu_amx\)")
    with pytest.raises(UnsupportedCacheError, match=refused):
        check_backends(cpu.plan, layers(list(cpu.plan.layers), "CPU_ATTN", "amx"))
    with pytest.raises(UnsupportedCacheError, match=r"kernels 'neon' for torch.float32 pages planned as vllm_cpu"):
        check_backends(cpu.plan, layers(list(cpu.plan.layers), "CPU_ATTN", "neon"))
    gpu = Deployment(config, cache_config(["full"]), layout=KVLayout.VLLM)
    with pytest.raises(UnsupportedCacheError, match=r"backend ROCM_AITER_FA \(known: FLASHINFER, FLASH_ATTN"):
        check_backends(gpu.plan, layers(list(gpu.plan.layers), "ROCM_AITER_FA"))



def written_by_vllm(isa: str, head_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values, slots and the page tensor vLLM's CPU cache-writing op makes of them with ``isa``."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    num_blocks, num_heads, block_size, num_tokens = 4, 2, 32, 70
    key = torch.randn(num_tokens, num_heads, head_size, generator=generator).to(torch.bfloat16)
    value = torch.randn(num_tokens, num_heads, head_size, generator=generator).to(torch.bfloat16)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    # [num_blocks, num_heads, block_size, 2 * head_size], as vLLM's CPU backend allocates it
    cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_size, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return key, value, slot_mapping, cache


def has_cpu_attention_ops() -> bool:
    """Whether this vLLM build has the CPU backend's cache-writing op (its CPU build; not the CUDA wheel)."""
    try:
        from vllm import _custom_ops as ops

        return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache") and hasattr(ops, "cpu_attn_reshape_and_cache")
    except (ImportError, AttributeError, RuntimeError):
        return False


CPU_OPS = pytest.mark.skipif(not has_cpu_attention_ops(), reason="needs vLLM's CPU build (its CPU attention ops)")


@CPU_OPS
@pytest.mark.parametrize("head_size", [128, 80])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_the_pages_vllms_accepted_cpu_kernels_write_are_read_back_as_written(isa: str, head_size: int) -> None:
    key, value, slot_mapping, cache = written_by_vllm(isa, head_size)
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({"layer": cache}, layout=KVLayout.VLLM_CPU)
    (chunk,) = pack(manager, {"layer": cache}, slot_mapping)
    assert chunk.shape == (2, 1, len(slot_mapping), 2 * head_size)
    assert torch.equal(chunk[0, 0], key.flatten(1)) and torch.equal(chunk[1, 0], value.flatten(1))


@CPU_OPS
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's amx kernels need a CPU with AMX")
@pytest.mark.parametrize("head_size", [128, 64])
def test_the_pages_vllms_amx_kernels_write_are_read_back_and_written_as_they_write(head_size: int) -> None:
    """vLLM's amx kernels pack pages otherwise than its vec ones (the same keys and values land
    elsewhere); read in layout vllm_cpu_amx they give back what vLLM wrote, and unpacked into zeroed
    pages they make the bytes vLLM's op made."""
    key, value, slot_mapping, cache = written_by_vllm("amx", head_size)
    assert not torch.equal(cache, written_by_vllm("vec", head_size)[3])
    manager = KVLayerGroupsManager()
    manager.build_kv_layer_groups({"layer": cache}, layout=KVLayout.VLLM_CPU_AMX)
    (chunk,) = pack(manager, {"layer": cache}, slot_mapping)
    assert torch.equal(chunk[0, 0], key.flatten(1)) and torch.equal(chunk[1, 0], value.flatten(1))
    rebuilt = torch.zeros_like(cache)
    unpack(manager, {"layer": rebuilt}, [chunk], slot_mapping)
    assert torch.equal(rebuilt.view(torch.int16), cache.view(torch.int16))


def test_a_secret_seals_every_entry_and_saves_hold_bounded_host_memory(gemma3_dir: Path, tmp_path: Path) -> None:
    """With a secret file and encryption, entries are AES-GCM ciphertext under keyed keys, restored byte
    for byte; an engine without the secret finds nothing. Queued saves hold host buffers from a pool
    bounded by max_pending_bytes: with too small a pool, saves are dropped and counted, never blocking."""
    (tmp_path / "secret").write_text("deployment secret of 32 bytes..!")
    tokens = prompt(100)
    extra = file_store(tmp_path, secret_file=str(tmp_path / "secret"), encrypt=True)
    first, steps = fill(gemma3_dir, extra, ["sliding", "full"], tokens)
    (save,) = steps[0].metadata.saves
    store = FileStore(f"{tmp_path}/kv")
    values = [store.get(key) for key in store.iter_keys()]
    assert values and all(b'"seal":"aes-256-gcm"' in (value or b"") for value in values)
    assert first.side.host_buffers.held_bytes > 0  # the saves went through the host pool
    harness, second = fresh(gemma3_dir, extra, ["sliding", "full"])
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse")
    assert computed == 96
    got = token_rows(second, load.block_ids, range(64, 96))
    want = token_rows(first, save.block_ids, range(64, 96))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    stranger, _ = fresh(gemma3_dir, file_store(tmp_path), ["sliding", "full"])
    stranger.add("no-secret", tokens)
    assert not stranger.step().metadata.loads  # keyed keys: nothing addressed without the secret
    # A pool of one byte holds no chunk: every save is dropped, counted, and nothing is written.
    tiny = file_store(tmp_path / "tiny", max_pending_bytes=1)
    starved, _ = fill(gemma3_dir, tiny, ["sliding", "full"], tokens)
    assert starved.side.store is not None and starved.side.store.stats.dropped_saves == 3
    assert not list(FileStore(f"{tmp_path}/tiny/kv").iter_keys())


def test_settings_refuse_what_cannot_work_and_never_show_a_password(tmp_path: Path) -> None:
    with pytest.raises(ConnectorConfigError, match=r"'encrypt' needs a secret"):
        ConnectorSettings.from_extra_config({"store": f"file://{tmp_path}/kv", "encrypt": True})
    with pytest.raises(ConnectorConfigError, match=r"'secret_file': cannot read the secret file"):
        ConnectorSettings.from_extra_config({"store": f"file://{tmp_path}/kv", "secret_file": "/nonexistent"})
    with pytest.raises(ConnectorConfigError) as refused:
        ConnectorSettings.from_extra_config({"store": ["redis://:hunter2-secret@h:1/0", 3]})
    assert "hunter2-secret" not in str(refused.value) and ":***@" in str(refused.value)
    settings = ConnectorSettings.from_extra_config({"store": "redis://user:hunter2-secret@h:1/0"})
    assert "hunter2-secret" not in repr(settings) and settings.stores == ("redis://user:hunter2-secret@h:1/0",)


@pytest.mark.parametrize("version", ["0.99.1", "this vLLM's own"])
def test_a_vllm_release_the_tests_never_ran_against_is_named_once_at_start_up(
        version: str, gemma3_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector cannot run vLLM's engine twice to check a restore: on a release its tests never ran
    against it says so once, naming the version (the scheduler's connector, not each worker's)."""
    from kvgroups.integrations.vllm.versions import TESTED_VLLM, release

    if version != "0.99.1":
        version = vllm.__version__
        assert release(version) in TESTED_VLLM  # what make test runs on is what the tests ran against
    monkeypatch.setattr(vllm, "__version__", version)
    harness, worker = fresh(gemma3_dir, file_store(tmp_path), ["sliding", "full"])
    assert harness.connector is not None and worker is not None
    named = [record.getMessage() for record in caplog.records
             if record.levelname == "WARNING" and "not a release its tests ran against" in record.getMessage()]
    assert named == ([] if release(version) in TESTED_VLLM else [named[0]])
    if named:
        assert f"vLLM {version} " in named[0] and all(tested in named[0] for tested in TESTED_VLLM)


@pytest.mark.parametrize(("spec_class", "field_name", "refused"), [
    ("FullAttentionSpec", "non_causal", r"non_causal: its attention reads tokens after each one"),
    ("FullAttentionSpec", "kv_head_major_slots", r"kv_head_major_slots: its page slots are grouped by KV head"),
    ("MLAAttentionSpec", "non_causal_multi_token_decode",
     r"non_causal_multi_token_decode: its decode rows attend to tokens after them"),
])
def test_spec_fields_that_change_what_a_page_holds_are_refused_by_name(spec_class: str, field_name: str,
                                                                       refused: str) -> None:
    """Fields vLLM added to its specs (0.34: kv_head_major_slots; non_causal_multi_token_decode on MLA) or that
    a plan ignoring them would store wrongly: each refuses the layer, naming itself, on the releases that have it."""
    from vllm.v1 import kv_cache_interface

    from kvgroups.integrations.vllm.engine_groups import layer_plan

    cls = getattr(kv_cache_interface, spec_class)
    if field_name not in {field.name for field in dataclasses.fields(cls)}:
        pytest.skip(f"vLLM {vllm.__version__}'s {spec_class} has no {field_name}")
    arguments = {"block_size": 16, "num_kv_heads": 1 if spec_class == "MLAAttentionSpec" else 2, "head_size": 64,
                 "dtype": torch.float32}
    layout = KVLayout.MLA if spec_class == "MLAAttentionSpec" else KVLayout.VLLM
    assert layer_plan("model.layers.0.attn", cls(**arguments), layout).name == "model.layers.0.attn"
    with pytest.raises(UnsupportedCacheError, match=rf"layer 'model.layers.0.attn' \({spec_class}\): {refused}"):
        layer_plan("model.layers.0.attn", cls(**arguments, **{field_name: True}), layout)


def _every_spec_kind() -> list[tuple[str, dict[str, Any]]]:
    """Each KV-cache spec class of the installed vLLM with the fields it needs beyond an attention spec's."""
    attention = {"block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": torch.float32}
    return [
        ("CircularBufferSpec", attention),
        ("RSWASpec", {**attention, "rswa_window": 64}),
        ("SinkFullAttentionSpec", {**attention, "sink_len": 4}),
        ("HiddenStateCacheSpec", attention),
        ("HiSparseHotSpec", {"block_size": 16, "page_size": 4096, "blocks_per_request": 4}),
        ("HiSparseResidentSpec", {"block_size": 16, "page_size": 4096}),
        ("CrossAttentionSpec", {**attention, "num_kv_heads": 2}),
    ]


@pytest.mark.parametrize(("spec_class", "arguments"), _every_spec_kind(), ids=[kind for kind, _ in _every_spec_kind()])
def test_every_other_kind_vllm_defines_is_refused_naming_it_and_why(spec_class: str, arguments: dict[str, Any]) -> None:
    """The kinds vLLM 0.32-0.34 define for models in its registry that the connector does not plan: each
    refuses its layer naming the kind and the reason (kvgroups.integrations.vllm.refused_specs)."""
    from vllm.v1 import kv_cache_interface

    from kvgroups.integrations.vllm.engine_groups import layer_plan
    from kvgroups.integrations.vllm.refused_specs import REASONS

    cls = getattr(kv_cache_interface, spec_class, None)
    if cls is None:
        pytest.skip(f"vLLM {vllm.__version__} has no {spec_class}")
    with pytest.raises(UnsupportedCacheError) as refused:
        layer_plan("model.layers.3.attn", cls(**arguments), KVLayout.VLLM)
    assert str(refused.value) == f"layer 'model.layers.3.attn': {spec_class}: {REASONS[spec_class]}"


def test_deepseek_v4_pages_are_planned_whole_and_a_bounded_replay_window_refused() -> None:
    """DeepSeek-V4's packed pages: moved by page (one slot per block), its compressed rows one page per 256
    tokens, its windows the last pages vLLM keeps for a hit; V4.1's bounded-replay window refused."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    from kvgroups import CompressedRows, WindowPages
    from kvgroups.integrations.vllm.engine_groups import layer_plan

    rows = layer_plan("model.layers.2.attn", MLAAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=4,
        state_content_bytes=584, alignment=576), KVLayout.MLA)
    assert (rows.spec, rows.page_bytes, rows.dtype) == (CompressedRows(tokens_per_row=256), 64 * 584, torch.uint8)
    window = layer_plan("model.layers.2.attn.swa_cache", SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8, sliding_window=128,
        state_content_bytes=584, alignment=576), KVLayout.MLA)
    assert (window.spec, window.page_bytes) == (WindowPages(page_tokens=64, pages=2), 64 * 584)
    state = layer_plan("model.layers.3.attn.compressor.state_cache", SlidingWindowMLASpec(
        block_size=8, num_kv_heads=1, head_size=1024, dtype=torch.float32, sliding_window=128), KVLayout.MLA)
    assert (state.spec, state.page_bytes) == (WindowPages(page_tokens=8, pages=16), 8 * 1024 * 4)
    fields = {field.name for field in dataclasses.fields(SlidingWindowMLASpec)}
    if "bounded_replay" in fields:
        with pytest.raises(UnsupportedCacheError, match=r"bounded_replay \(DeepSeek-V4.1\)"):
            layer_plan("x", SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                                                 sliding_window=128, bounded_replay=True), KVLayout.MLA)
