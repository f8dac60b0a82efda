"""DeepSeek-V4 through the connector, with vLLM's real Scheduler and KV-cache manager: every group's bytes
restored exactly, at the hits vLLM's own managers take.

vLLM's own code makes the caches (the specs DeepSeek-V4's cache modules declare, its planner's five groups in
one block pool, its model runner's BLHNC views of one buffer: :mod:`tests.integrations.vllm.deepseek_v4`).
The model's forward is stood in for by the worker's buffer, filled with random bytes before the run: what it
holds is what a forward would have written, so that a worker that saved a prompt and another that loaded it
must hold the same bytes where the boundary needs them (every compressed row and indexer key before it, the
window's and the compressor states' last pages). Runs on vLLM 0.32, 0.33 and 0.34.

On vLLM 0.32 (its CPU build), two of vLLM's engines, one after the other, serve a prompt with a stand-in forward
that writes known bytes where vLLM's kernels would (:mod:`tests.integrations.vllm.deepseek_v4_engine`): the one
that loads holds every byte the one that saved wrote, and answers from them alike.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvgroups import CompressedRows, WindowPages
from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.plans import chunk_slots
from kvgroups.integrations.vllm.worker_side import WorkerSide
from tests.integrations.vllm.deepseek_v4 import (
    buffer_bytes,
    kv_cache_config,
    scheduler_kv_cache_config,
    tiny_config_dir,
    vllm_specs,
    worker_views,
)
from tests.integrations.vllm.harness import ENGINE_LAYOUT, SchedulerHarness, file_store, prompt, vllm_config
from tests.support.paths import ROOT

CHUNK = 256  # lcm of the groups' blocks (64, 256, 4, 8): vLLM's own hits land on it too
PROMPT = 600


class DeepseekV4Worker:
    """A worker's DeepSeek-V4 caches: vLLM's views of one int8 buffer of random bytes, bound to a WorkerSide."""

    def __init__(self, config: Any, kv_config: Any, seed: int) -> None:
        self.deployment = Deployment(config, kv_config, layout=ENGINE_LAYOUT)
        generator = torch.Generator().manual_seed(seed)
        self.buffer = torch.randint(-128, 128, (buffer_bytes(kv_config),), dtype=torch.int8, generator=generator)
        self.caches = worker_views(kv_config, self.buffer)
        self.side = WorkerSide(self.deployment, rank=0)
        self.side.register(self.caches)

    def pages(self, member: int, slots: np.ndarray) -> torch.Tensor:
        return self.side.transfers[member].pack(torch.from_numpy(slots))[0]


def engine(tmp_path: Path, *, kv_events: bool = False) -> tuple[Any, Any, Any]:
    """vLLM's config, the workers' KV-cache config and the scheduler's (one spec per group: its first layer's)."""
    folder = tiny_config_dir(tmp_path / "model")
    config = vllm_config(folder, file_store(tmp_path, chunk_size=None), block_size=256, max_batched=1024,
                         kv_events=kv_events, prefix_caching=kv_events)
    config.cache_config.kv_cache_layout = "BLHNC"  # as DeepSeek-V4's indexer backend resolves it
    # A GPU platform keeps vLLM's hybrid KV-cache manager on (the connector supports it); the "unspecified"
    # platform of 0.33's and 0.34's CUDA wheels on this CPU turns it off, and so would make other groups.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    specs = vllm_specs(folder, vllm_config=config)
    workers = kv_cache_config(config, specs, 96 << 20)
    return config, workers, scheduler_kv_cache_config(workers)


def scheduler(config: Any, kv_config: Any) -> SchedulerHarness:
    """vLLM's Scheduler hashing requests as its engine core does for these groups: in their blocks' GCD (4)."""
    blocks = [group.kv_cache_spec.block_size for group in kv_config.kv_cache_groups]
    return SchedulerHarness(config, kv_config, hash_block_size=math.gcd(*blocks))


def test_every_deepseek_v4_group_is_restored_byte_for_byte_at_vllms_hits(tmp_path: Path) -> None:
    config, kv_config, scheduler_config = engine(tmp_path)
    saver = DeepseekV4Worker(config, kv_config, seed=1)
    kinds = {type(group.spec) for group in saver.deployment.groups}
    assert kinds == {CompressedRows, WindowPages}
    first = scheduler(config, scheduler_config)
    first.add("a", prompt(PROMPT))
    steps = first.run(saver)
    saves = {chunk: plan for step in steps for plan in step.metadata.saves for chunk in plan.chunks}
    assert sorted(saves) == [0, 1]  # the prompt's full chunks (600 tokens: 2 of 256)

    loader = DeepseekV4Worker(config, kv_config, seed=2)
    second = scheduler(config, scheduler_config)
    second.add("b", prompt(PROMPT))
    _, computed, load = second.admit(loader, "b")
    # vLLM's own prefix cache would hit here too: the longest multiple of 256 before the last token.
    assert computed == 512 and load is not None and load.num_tokens == 512

    restored = 0
    for engine_group in loader.side.engine_groups:
        for member in engine_group.members:
            spec = loader.deployment.groups[member].spec
            start, _ = spec.tokens_needed(512)
            for chunk in range(start // CHUNK, 2):
                plan = saves[chunk]
                ours = chunk_slots(spec, chunk * CHUNK, (chunk + 1) * CHUNK,
                                   np.asarray(plan.block_ids[engine_group.index]), engine_group.block_size)
                theirs = chunk_slots(spec, chunk * CHUNK, (chunk + 1) * CHUNK,
                                     np.asarray(load.block_ids[engine_group.index]), engine_group.block_size)
                if isinstance(spec, WindowPages) and chunk < 1:
                    continue  # a window needs only the pages before the boundary
                assert (ours >= 0).all() and (theirs >= 0).all(), (member, chunk)
                assert torch.equal(saver.pages(member, ours), loader.pages(member, theirs)), (member, chunk)
                restored += int(ours.size)
    # Every group, every page a boundary at 512 needs: 2 pages per compressed group (one per chunk), the window's
    # last 2, the ratio-4 states' last 2, the ratio-128 states' last 16.
    assert restored == sum(2 if isinstance(group.spec, CompressedRows) else group.spec.pages
                           for group in loader.deployment.groups)


def served_by_an_engine(store: Path) -> dict[str, Any]:
    """One vLLM 0.32 engine (its CPU build) on a tiny random DeepSeek-V4, its forward stood in for
    (:mod:`tests.integrations.vllm.deepseek_v4_engine`), serving one prompt through the connector on ``store``."""
    # As the other engine tests run theirs (engine_runner): a cache of 1 GiB, not a share of the machine's memory
    # (vLLM's CPU build refuses to start when other tests hold what that share needs), this checkout's source.
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    result = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.deepseek_v4_engine", str(store)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=environment, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_two_engines_one_saving_one_loading_hold_every_deepseek_v4_page_alike(tmp_path: Path) -> None:
    """vLLM's engine started on DeepSeek-V4 with the connector: the worker binds every cache vLLM allocates (moved by
    page) and the scheduler side, which vLLM hands one spec per group, plans the same groups (the same fingerprint,
    so the same keys). Two engines, one after the other, serve the same 600-token prompt with a stand-in forward:
    the second loads 512 tokens (vLLM's own hit there) and then holds, in every group, every byte the first wrote
    of every page the boundary needs (each compressed page before it, the window's and the compressor states' last
    pages) and of every page both computed after it; its answer, read from those bytes, is the first's."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's engine runs on this machine only in its CPU build (0.32)")
    store = tmp_path / "kv"
    saver = served_by_an_engine(store)
    assert saver["scheduler_fingerprint"] == saver["worker_fingerprint"]
    layers = {layer: group["spec"] for group in saver["groups"] for layer in group["layers"]}
    assert layers["model.layers.0.attn.swa_cache"] == {"kind": "window_pages", "page_tokens": 64, "pages": 2}
    assert layers["model.layers.2.attn"] == layers["model.layers.3.attn"] == {
        "kind": "compressed", "tokens_per_row": 256}
    assert layers["model.layers.2.attn.compressor.state_cache"] == {"kind": "window_pages", "page_tokens": 4,
                                                                    "pages": 2}
    assert layers["model.layers.3.attn.compressor.state_cache"] == {"kind": "window_pages", "page_tokens": 8,
                                                                    "pages": 16}
    assert len(layers) == 5 + 3 + 2 * 2 + 3  # windows, rows, the CSA layers' indexers and states, the states
    assert set(layers) == set(saver["pages"])
    assert set(saver["engine_group_blocks"]) == {4, 8, 64, 256} and saver["chunk_size"] == 256
    assert saver["cached"] == 0

    loader = served_by_an_engine(store)
    assert loader["cached"] == 512  # the longest multiple of 256 before the last token, as vLLM's own cache hits
    assert loader["tokens"] == saver["tokens"]
    compared = 0
    for layer, spec in layers.items():
        # The first page the boundary at 512 needs: every compressed page; a window's last `pages` pages before it.
        first = 0 if spec["kind"] == "compressed" else 512 // spec["page_tokens"] - spec["pages"]
        ours, theirs = saver["pages"][layer], loader["pages"][layer]
        pages = [index for index in ours if int(index) >= first]
        assert len(pages) == len(ours) - first  # the request's every page from there on
        for index in pages:
            assert theirs.get(index) == ours[index], (layer, index)
        compared += len(pages)
    # Positions 0-602 written (the prompt, then 3 of the 4 tokens answered fed back): 3 pages per compressed layer (2
    # loaded, 1 computed), the windows' 2 loaded of 64 tokens + 2 computed, the ratio-4 states' 2 loaded + 23
    # computed, the ratio-128 states' 16 + 12.
    assert compared == 5 * 3 + 5 * 4 + 4 * 25 + 28


def test_kv_events_announce_each_deepseek_v4_group_s_stored_chunks(tmp_path: Path) -> None:
    """With vLLM's KV events on, every vLLM group's stored chunks are announced (medium DISK) in its own blocks,
    with vLLM's own block hashes (in blocks of 4 tokens, the groups' GCD), beside vLLM's events of the same."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

    config, kv_config, scheduler_config = engine(tmp_path, kv_events=True)
    harness = scheduler(config, scheduler_config)
    published: list[Any] = []
    harness.scheduler.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    worker = DeepseekV4Worker(config, kv_config, seed=1)
    request = harness.add("a", prompt(PROMPT))
    harness.run(worker)
    harness.step(worker)  # the saves written by now: announced
    ours = [event for batch in published for event in batch.events if getattr(event, "medium", None) == "DISK"]
    assert all(isinstance(event, BlockStored) for event in ours)
    blocks = {group.index: group.block_size for group in worker.side.engine_groups}
    announced = sorted((event.group_idx, event.block_size, len(event.block_hashes)) for event in ours)
    assert announced == sorted((group, size, CHUNK // size) for group, size in blocks.items() for _ in (0, 1))
    # vLLM's own hashes of those blocks: its requests' hashes (of 4 tokens) in each group's blocks, and where it
    # announces its own blocks (0.33, 0.34: prefix caching on) among them for the compressed rows' group, every
    # block of which it caches (a window's it may drop before it announces them).
    hashes = {size: [maybe_convert_block_hash(each) for each in resolve_block_hashes(request.block_hashes, 4, size)]
              for size in set(blocks.values())}
    own: dict[int, set[Any]] = {}
    for batch in published:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium != "DISK":
                own.setdefault(event.group_idx, set()).update(event.block_hashes)
    for event in ours:
        chunk = next(index for index in (0, 1) if event.token_ids == prompt(PROMPT)[index * CHUNK:(index + 1) * CHUNK])
        size = event.block_size
        assert event.block_hashes == hashes[size][chunk * CHUNK // size:(chunk + 1) * CHUNK // size]
        if event.group_idx in own and size == CHUNK:  # the rows' group, whose every block vLLM caches and announces
            assert set(event.block_hashes) <= own[event.group_idx]


def test_groups_whose_blocks_requests_are_not_hashed_in_get_no_event_and_the_scheduler_runs_on(tmp_path: Path) -> None:
    """A scheduler hashing requests in blocks of 256 tokens (no prefix caching, no connector: vLLM's own choice
    then) cannot name the 64-, 4- and 8-token blocks of the windows and states: their chunks are announced by no
    event, the rows' group's are, and planning the saves raises nothing (it did: vLLM's resolve_block_hashes
    asserts)."""
    config, kv_config, scheduler_config = engine(tmp_path, kv_events=True)
    try:
        harness = SchedulerHarness(config, scheduler_config)  # hashes in the groups' LCM: 256 tokens
    except AssertionError as refused:  # vLLM 0.33 and later refuse such a scheduler themselves
        pytest.skip(f"vLLM refuses a hash block no group's block divides: {refused}")
    published: list[Any] = []
    harness.scheduler.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    worker = DeepseekV4Worker(config, kv_config, seed=1)
    harness.add("a", prompt(PROMPT))
    harness.run(worker)
    harness.step(worker)
    ours = [event for batch in published for event in batch.events if getattr(event, "medium", None) == "DISK"]
    assert sorted(event.block_size for event in ours) == [256] * 2
