"""Recurrent states under vLLM's prefix caching (``mamba_cache_mode`` "align", vLLM's default for hybrids).

vLLM's real Scheduler with its prefix cache on, fake caches, and a stand-in for the model that
writes into a recurrent group's blocks what vLLM's model runner keeps there: the state after ``n``
tokens in the block at ``n // block_size - 1`` where a step ends (its running state), and, for a
mixer that exports a prefill checkpoint (vLLM's MambaMixer2), the state at the prompt's last block
boundary in the block vLLM reserved for it. Each state block says how many tokens it has seen, so
a restored state is known to be the one at the hit's end. One engine fills the store, a fresh one
reuses it: states and K/V byte for byte, in both load modes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.model_executor.layers.mamba.checkpoint import compute_mamba_prefill_checkpoints
from vllm.utils.math_utils import cdiv

from kvgroups.integrations.vllm.deployment import Deployment
from tests.integrations.vllm.harness import (
    DTYPE,
    STATE_SHAPES,
    FakeWorker,
    SchedulerHarness,
    Step,
    cache_config,
    connector_stats,
    file_store,
    prompt,
    token_rows,
    vllm_config,
)

BLOCK = 16
STATE_BYTES = sum(torch.Size(shape).numel() for shape in STATE_SHAPES) * DTYPE.itemsize


def seen(tokens: int) -> int:
    """What a state block holds (every byte) after ``tokens`` tokens."""
    return tokens % 127


class Model:
    """Stands in for vLLM's model runner on the recurrent groups of ``workers``' caches."""

    def __init__(self, harness: SchedulerHarness, *workers: FakeWorker) -> None:
        self.harness = harness
        self.workers = workers

    def __call__(self, step: Step) -> None:
        scheduler = self.harness.scheduler
        for request_id, num_scheduled in step.output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            end = request.num_computed_tokens  # advanced past this step when it was scheduled
            block_ids = scheduler.kv_cache_manager.get_block_ids(request_id)
            for worker in self.workers:
                for engine_group in worker.side.engine_groups:
                    if engine_group.token_indexed:
                        continue
                    ids = block_ids[engine_group.index]
                    spec = worker.kv_cache_config.kv_cache_groups[engine_group.index].kv_cache_spec
                    # The running state: in the block of the step's last token.
                    self._write(worker, engine_group.layer_names, ids[cdiv(end, BLOCK) - 1], end)
                    if spec.num_prefill_checkpoint_blocks:  # exported inside the step, where vLLM's forward does
                        (offset,), (column,) = compute_mamba_prefill_checkpoints(
                            [end], [num_scheduled], hash_block_size=BLOCK, mamba_block_size=BLOCK,
                            checkpoint_alignment=spec.prefill_checkpoint_alignment, drop_eagle_block=False,
                            cache_hit_alignment_tokens=BLOCK)
                        if column >= 0:
                            self._write(worker, engine_group.layer_names, ids[column], end - num_scheduled + offset)

    @staticmethod
    def _write(worker: FakeWorker, names: tuple[str, ...], block: int, tokens: int) -> None:
        assert block != 0
        for name in names:
            worker.caches[name][block].fill_(seen(tokens))


def state_pages(worker: FakeWorker, block: int) -> list[torch.Tensor]:
    """Every recurrent layer's state bytes in ``block``."""
    return [worker.caches[name][block].flatten()[:STATE_BYTES]
            for engine_group in worker.side.engine_groups if not engine_group.token_indexed
            for name in engine_group.layer_names]


def engine(model_dir: Path, extra: dict[str, Any], kinds: list[str], *, seed: int, max_batched: int = 256,
           **config: Any) -> tuple[SchedulerHarness, FakeWorker, Model]:
    """An engine with vLLM's prefix cache on (so "align" mode), its scheduler, a worker and the model."""
    kv = cache_config(kinds, block_size=BLOCK, mamba_mode="align")
    settings = vllm_config(model_dir, extra, block_size=BLOCK, max_batched=max_batched, mamba_mode="align",
                           prefix_caching=True, **config)
    harness, worker = SchedulerHarness(settings, kv), FakeWorker(settings, kv, seed=seed)
    return harness, worker, Model(harness, worker)


@pytest.mark.parametrize(("kinds", "load_mode"), [
    (["mamba", "full"], "async"), (["mamba"], "async"), (["mamba"], "sync"), (["mamba", "sliding", "full"], "async"),
], ids=["hybrid-async", "mamba-async", "mamba-sync", "hybrid-sliding-async"])
def test_a_hit_restores_the_state_into_the_block_vllm_continues_from(gemma3_dir: Path, tmp_path: Path,
                                                                      kinds: list[str], load_mode: str) -> None:
    tokens = prompt(100)
    extra = file_store(tmp_path, chunk_size=None, load_mode=load_mode)  # a chunk: vLLM's grid of 16 tokens
    filler, first, model = engine(gemma3_dir, extra, kinds, seed=0)
    assert filler.connector._scheduler.chunk_size == BLOCK
    filler.add("fill", tokens)
    steps = filler.run(first, forward=model)
    # vLLM ends the prompt's first step at its last block boundary (96), where it keeps a state.
    saves = [save for step in steps for save in step.metadata.saves]
    assert [(save.chunks, save.step_end) for save in saves] == [(tuple(range(6)), 96)]
    mamba = next(group.index for group in first.side.engine_groups if not group.token_indexed)
    state_96 = saves[0].block_ids[mamba][96 // BLOCK - 1]
    assert all((page == seen(96)).all() for page in state_pages(first, state_96))

    harness, second, model = engine(gemma3_dir, extra, kinds, seed=1)
    harness.add("reuse", tokens)
    admitted, computed, load = harness.admit(second, "reuse", forward=model)
    assert computed == 96 and (load.num_tokens, load.local_tokens) == (96, 0)
    # vLLM would recompute a failed synchronous load of a state on its grid from the block before it, whose
    # state it does not hold: such a load is asynchronous (a failure recomputes the request from its start).
    assert load.asynchronous
    assert not any(step.failed_loads or step.invalid_blocks for step in admitted)
    # The state lands where vLLM's model runner continues from ((96 - 1) // 16): block 5 of the group.
    state_ids = load.block_ids[mamba]
    assert state_ids[:5] == (0,) * 5 and state_ids[5] != 0
    got, want = state_pages(second, state_ids[5]), state_pages(first, state_96)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(got, want, strict=True))
    # K/V of every attention group byte for byte (a window's blocks only), as in "none" mode.
    if "full" in kinds:  # the full-attention group: all 96 tokens (a window's, only its blocks)
        (*_, restored), (*_, stored) = token_rows(second, load.block_ids, range(96)), token_rows(
            first, saves[0].block_ids, range(96))
        assert restored.shape[2] == 96
        assert torch.equal(restored.view(torch.uint8), stored.view(torch.uint8))


def test_the_store_continues_a_hit_of_vllms_own_prefix_cache(gemma3_dir: Path, tmp_path: Path) -> None:
    """Local hit, then the store, then compute: vLLM's own cache holds a state at 48 tokens (a request that
    stopped there), the store holds the prompt to 96; the load reads only what lies past 48 and writes
    the state at 96 where vLLM continues, and the stats count the two parts apart."""
    tokens = prompt(100)
    extra = file_store(tmp_path, chunk_size=None)
    filler, first, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=0)
    filler.add("fill", tokens)
    (fill_step, *_) = filler.run(first, forward=model)
    (save,) = fill_step.metadata.saves

    harness, second, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=1)
    # Its own prompt ends 5 tokens past block 3: vLLM keeps the state at 48, where a request may resume.
    harness.add("warm", tokens[:48] + prompt(5, seed=3), kv_transfer_params={"kvgroups": {"load": False,
                                                                                            "save": False}})
    (warm_step, *_) = harness.run(second, forward=model)
    (warm,) = warm_step.output.scheduled_new_reqs
    store = second.side.store
    assert store is not None
    read_before = sum(store.stats.bytes_read)
    local = token_rows(second, tuple(tuple(ids) for ids in warm.block_ids), range(48))
    harness.add("reuse", tokens)
    admitted, computed, load = harness.admit(second, "reuse", forward=model)
    assert computed == 96 and (load.num_tokens, load.local_tokens) == (96, 48)
    # Only the entries past vLLM's own hit are read: 3 chunks of K/V (1 KiB a token) and one state.
    assert 48 * 1024 + STATE_BYTES * 2 < sum(store.stats.bytes_read) - read_before < 51 * 1024 + STATE_BYTES * 2
    (got,), (want,) = token_rows(second, load.block_ids, range(96)), token_rows(first, save.block_ids, range(96))
    assert torch.equal(got[:, :, 48:].view(torch.uint8), want[:, :, 48:].view(torch.uint8))
    assert torch.equal(got[:, :, :48].view(torch.uint8), local[0].view(torch.uint8))  # vLLM's, left alone
    state_ids = load.block_ids[0]
    assert all((page == seen(96)).all() for page in state_pages(second, state_ids[96 // BLOCK - 1]))
    stats = connector_stats(admitted, second)
    counters = stats.data["counters"]
    assert (counters["continued_hits"], counters["continued_local_tokens"], counters["continued_store_tokens"]) \
        == (1, 48, 48)
    assert stats.reduce()["continued_local_tokens"] == 48


def test_a_state_a_forward_exports_inside_its_step_is_saved_from_the_block_vllm_hands_over(
        gemma3_dir: Path, tmp_path: Path) -> None:
    """vLLM's MambaMixer2 exports the state at the prompt's last block boundary from inside the step (no
    step ends there); vLLM hands its block to the connector (boundary_state_offloads), which saves it."""
    tokens = prompt(100)
    extra = file_store(tmp_path, chunk_size=None)
    filler, first, model = engine(gemma3_dir, extra, ["mamba2", "full"], seed=0)
    filler.add("fill", tokens)
    steps = filler.run(first, forward=model)
    saves = [save for step in steps for save in step.metadata.saves]
    assert [(save.chunks, save.step_end) for save in saves] == [(tuple(range(6)), 100)]  # one step: no stop at 96
    (save,) = saves
    assert [(group, boundary) for group, boundary, _ in save.boundary_states] == [(0, 96)]
    (_, _, exported), running = save.boundary_states[0], save.block_ids[0][cdiv(100, BLOCK) - 1]
    assert exported != running  # the running state (at 100, then decoding on) is elsewhere

    harness, second, model = engine(gemma3_dir, extra, ["mamba2", "full"], seed=1)
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse", forward=model)
    assert computed == 96
    restored = state_pages(second, load.block_ids[0][96 // BLOCK - 1])
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(restored, state_pages(first, exported),
                                                                   strict=True))
    assert (restored[0] == seen(96)).all()


def test_every_state_vllm_keeps_is_saved_under_dense_retention(gemma3_dir: Path, tmp_path: Path) -> None:
    """With every state retained (prefix_cache_retention_interval None) and steps of 40 tokens, vLLM ends
    steps on its block grid (32, 64, 96) and keeps each; each is stored, and a prompt sharing only the
    first 70 tokens hits at 64."""
    tokens = prompt(100)
    extra = file_store(tmp_path, chunk_size=None)
    filler, first, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=0, max_batched=40,
                                  retention_interval=None)
    filler.add("fill", tokens)
    steps = filler.run(first, forward=model)
    ends = [save.step_end for step in steps for save in step.metadata.saves]
    assert ends == [32, 64, 96]
    handed = [boundary for step in steps for save in step.metadata.saves for _, boundary, _ in save.boundary_states]
    assert handed == [32, 64, 96]
    harness, second, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=1)
    harness.add("shared", tokens[:70] + prompt(40, seed=4))
    _, computed, load = harness.admit(second, "shared", forward=model)
    assert computed == 64
    assert (state_pages(second, load.block_ids[0][64 // BLOCK - 1])[0] == seen(64)).all()


def test_a_hit_needs_the_state_at_its_end(gemma3_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A chunk longer than vLLM's grid: its state exists only where a step ended on its boundary. Steps end
    at 96 here, not a multiple of 64: K/V of the first chunk is stored, its state is not, and no hit is
    ever reported without it (the start-up log says why)."""
    tokens = prompt(100)
    extra = file_store(tmp_path, chunk_size=64)
    with caplog.at_level(logging.WARNING):
        filler, first, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=0)
    assert "chunk_size 64 is longer than vLLM's grid of recurrent states" in caplog.text
    filler.add("fill", tokens)
    filler.run(first, forward=model)
    harness, second, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=1)
    harness.add("reuse", tokens)
    assert harness.admit(second, "reuse", forward=model)[1] == 0


def test_the_chunk_follows_vllms_grid_of_states(gemma3_dir: Path, tmp_path: Path) -> None:
    def deployment(chunk_size: int | None, mamba_mode: str, block_size: int = BLOCK) -> Deployment:
        kv = cache_config(["mamba", "full"], block_size=block_size, mamba_mode=mamba_mode)
        return Deployment(vllm_config(gemma3_dir, file_store(tmp_path, chunk_size=chunk_size), block_size=block_size,
                                      mamba_mode=mamba_mode, prefix_caching=mamba_mode == "align"), kv)

    # On the grid: one grid step, however small; off it (a state per request), at least 256 tokens.
    assert deployment(None, "align").settings.chunk_size == 16
    assert deployment(None, "align", block_size=288).settings.chunk_size == 288
    assert deployment(None, "none").settings.chunk_size == 256
    aligned = deployment(48, "align")
    assert aligned.settings.chunk_size == 48 and aligned.sparse_states and aligned.unservable is None
    assert not deployment(16, "align").sparse_states


def test_a_synchronous_load_of_states_on_vllms_grid_loads_asynchronously(gemma3_dir: Path, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """vLLM recomputes a failed synchronous load from the first failed block: for a state on its grid that
    is the block before the state, whose state vLLM does not hold (its table is null there). So even a
    model of one recurrent group loads asynchronously, whose failure recomputes the request from 0."""
    with caplog.at_level(logging.WARNING):
        harness, _, _ = engine(gemma3_dir, file_store(tmp_path, chunk_size=None, load_mode="sync"), ["mamba"], seed=0)
    assert harness.connector._scheduler.asynchronous
    assert "load_mode 'sync' is not safe for this model (vLLM would recompute a failed synchronous load from the " \
           "block before the state" in caplog.text


def test_a_block_size_vllm_resets_in_its_engine_core_process_is_set_back(gemma3_dir: Path, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's engine-core process (vllm serve, LLM with multiprocessing) runs VllmConfig.__post_init__ again
    once the scheduler holds the config, and on the CPU platform that resets the block size vLLM chose for
    a hybrid (384 for a qwen3-next-like model) to 128: the scheduler then ended prefill steps off the
    states' grid, kept no state at any chunk's end, and every chunk was saved without one (issue 43).
    Here the grid is 16 and the reset makes it 10: the connector sets it back before the first step is
    cut, says so once, and the states are saved and served as on the grid."""
    tokens = prompt(100)
    extra = file_store(tmp_path, chunk_size=None)
    filler, first, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=0)
    filler.scheduler.cache_config.block_size = 10  # what EngineCoreProc's second __post_init__ does
    with caplog.at_level(logging.WARNING, logger="kvgroups"):
        filler.add("fill", tokens)
        steps = filler.run(first, forward=model)
    assert filler.scheduler.cache_config.block_size == BLOCK
    set_back = [record.getMessage() for record in caplog.records if "set back to 16" in record.getMessage()]
    assert len(set_back) == 1 and "block_size is 10" in set_back[0]
    saves = [save for step in steps for save in step.metadata.saves]
    assert [(save.chunks, save.step_end) for save in saves] == [(tuple(range(6)), 96)]
    assert filler.connector._scheduler.counts.stateless_saves == 0

    harness, second, model = engine(gemma3_dir, extra, ["mamba", "full"], seed=1)
    harness.scheduler.cache_config.block_size = 10
    harness.add("reuse", tokens)
    _, computed, load = harness.admit(second, "reuse", forward=model)
    assert computed == 96 and load.num_tokens == 96
    assert all((page == seen(96)).all() for page in state_pages(second, load.block_ids[0][96 // BLOCK - 1]))


def test_chunks_saved_without_their_state_are_counted_and_said_once(gemma3_dir: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Prefix caching off (mamba_cache_mode "none"): a state exists only where a step ends, so a prompt computed
    in one step of 100 tokens saves chunks 0-2 (of 32) with K/V only and no state at any of their ends. Each
    such step's saves are counted (none can end a hit), and the first is a warning: a hybrid whose states
    are never saved is never silent."""
    kv = cache_config(["mamba", "full"], block_size=BLOCK)
    settings = vllm_config(gemma3_dir, file_store(tmp_path), block_size=BLOCK)
    harness, worker = SchedulerHarness(settings, kv), FakeWorker(settings, kv, seed=0)
    with caplog.at_level(logging.WARNING, logger="kvgroups"):
        harness.add("fill", prompt(100))
        harness.add("again", prompt(100, seed=5))
        steps = harness.run(worker)
    saves = [save for step in steps for save in step.metadata.saves]
    assert sorted((save.chunks, save.step_end) for save in saves) == [((0, 1, 2), 100), ((0, 1, 2), 100)]
    assert harness.connector._scheduler.counts.stateless_saves == 2
    said = [record.getMessage() for record in caplog.records if "without a recurrent state" in record.getMessage()]
    assert len(said) == 1 and "kvgroups_stateless_saves_total" in said[0], caplog.text
    assert connector_stats(steps, worker).data["counters"]["stateless_saves"] == 2
