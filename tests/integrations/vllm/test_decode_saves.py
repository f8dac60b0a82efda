"""Chunks a reply fills, saved while it is generated, on vLLM's real Scheduler with speculative decoding.

A stand-in for the model writes every computed position's K/V from the token fed there (a draft's
own where a draft was fed), samples "true" tokens, and accepts the drafts that match them; the
drafts it proposes follow a pattern of hits and misses, across chunk ends. The next turn (the
prompt, the reply, a new message) runs on a fresh scheduler and worker: it loads every full chunk of
what the first request kept, and each loaded position holds the K/V of the token kept there, never
a rejected draft's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.utils.math_utils import cdiv

from kvgroups.datapath.slots import paged_slots
from tests.integrations.vllm.harness import (
    CHUNK,
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

SPEC_TOKENS = 3


def truth(position: int) -> int:
    """The token the stand-in model samples at ``position``."""
    return 4 + (position * 13 + 5) % 400


def kv_value(position: int, token: int) -> float:
    """What the stand-in model writes into every element of ``position``'s K/V, fed ``token`` there."""
    return ((position * 131 + token * 7) % 997) / 4.0


class DraftingModel:
    """The model, its sampler and its drafter; ``pattern``: how many drafts of each step are right, in turn."""

    def __init__(self, harness: SchedulerHarness, worker: FakeWorker, pattern: Sequence[int] = (SPEC_TOKENS,)) -> None:
        self.harness, self.worker, self.pattern = harness, worker, pattern
        self.spec_tokens = harness.scheduler.num_spec_tokens
        self.proposals = 0

    def __call__(self, step: Step) -> None:
        scheduler = self.harness.scheduler
        for request_id, num_scheduled in step.output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            drafts = list(step.output.scheduled_spec_decode_tokens.get(request_id, []))
            end = request.num_computed_tokens  # advanced past this step when it was scheduled
            start = end - num_scheduled
            fed = [*request.all_token_ids[start:end - len(drafts)], *drafts]
            self.write(scheduler.kv_cache_manager.get_block_ids(request_id), start, fed)

    def write(self, block_ids: Any, start: int, fed: Sequence[int]) -> None:
        positions = np.arange(start, start + len(fed))
        values = torch.tensor([kv_value(int(p), int(t)) for p, t in zip(positions, fed, strict=True)])
        for engine_group in self.worker.side.engine_groups:
            if not engine_group.token_indexed:
                continue
            slots = torch.from_numpy(paged_slots(positions, np.asarray(block_ids[engine_group.index], dtype=np.int64),
                                                 engine_group.block_size))
            for member in engine_group.members:
                transfer = self.worker.side.transfers[member]
                (rows,) = transfer.pack(slots)
                shape = [1] * rows.dim()
                shape[2] = len(fed)
                transfer.unpack([values.to(rows.dtype).view(shape).expand_as(rows).contiguous()], slots)

    def sample(self, request: Any, drafts: list[int]) -> list[int]:
        first = request.num_computed_tokens - len(drafts)  # the position of the first token sampled
        if first < len(request.all_token_ids):  # a prefill step that did not reach the prompt's end
            return []
        accepted = []
        for draft in drafts:
            if draft != truth(first + len(accepted)):
                break
            accepted.append(draft)
        return [*accepted, truth(first + len(accepted))]

    def propose(self, request: Any) -> list[int]:
        right = self.pattern[self.proposals % len(self.pattern)]
        self.proposals += 1
        position = len(request.all_token_ids)  # the first drafted token's
        return [truth(position + index) + (index >= right) for index in range(self.spec_tokens)]


def engine(model_dir: Path, extra: dict[str, Any], kinds: list[str], *, seed: int, spec_tokens: int,
           pattern: Sequence[int] = (SPEC_TOKENS,)) -> tuple[SchedulerHarness, FakeWorker, DraftingModel]:
    kv = cache_config(kinds, window=64, num_blocks=96)
    settings = vllm_config(model_dir, extra, spec_tokens=spec_tokens)
    harness, worker = SchedulerHarness(settings, kv), FakeWorker(settings, kv, seed=seed)
    return harness, worker, DraftingModel(harness, worker, pattern)


def converse(model_dir: Path, extra: dict[str, Any], kinds: list[str], first_prompt: list[int], reply_tokens: int,
             *, spec_tokens: int = SPEC_TOKENS, pattern: Sequence[int] = (SPEC_TOKENS,)) -> tuple[Any, list[Step]]:
    """One turn: the finished request (its tokens kept) and its steps."""
    harness, worker, model = engine(model_dir, extra, kinds, seed=0, spec_tokens=spec_tokens, pattern=pattern)
    request = harness.add("turn", first_prompt, max_tokens=reply_tokens)
    steps = harness.run(worker, max_steps=200, forward=model, sampler=model)
    assert not harness.scheduler.has_requests()
    assert harness.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == \
        harness.kv_cache_config.num_blocks - 1  # every block back (the null block aside)
    return request, steps


def next_turn(model_dir: Path, extra: dict[str, Any], kinds: list[str], tokens: list[int]) -> tuple[int, Any, Any]:
    """The next turn on a fresh engine: the tokens it loaded, its load plan and its worker."""
    harness, worker, model = engine(model_dir, extra, kinds, seed=1, spec_tokens=0)
    harness.add("next", tokens, max_tokens=1)
    _, computed, load = harness.admit(worker, "next", forward=model)
    return computed, load, worker


def assert_kept_kv(worker: FakeWorker, load: Any, kept: list[int]) -> None:
    """Every loaded position holds the K/V of the token the first request kept there (each attention group's)."""
    for row in token_rows(worker, load.block_ids, range(load.num_tokens)):
        positions = range(load.num_tokens - row.shape[2], load.num_tokens)  # a window keeps its last ones
        want = torch.tensor([kv_value(p, kept[p]) for p in positions], dtype=row.dtype)
        got = row.transpose(0, 2).reshape(row.shape[2], -1)
        assert torch.equal(got, want[:, None].expand_as(got))


@pytest.mark.parametrize("pattern", [(3,), (0,), (1, 3, 0, 2, 3, 3), (2,)], ids=["all-right", "all-wrong", "mixed",
                                                                               "two-of-three"])
def test_the_next_turn_loads_the_reply_with_every_kept_tokens_kv(gemma3_dir: Path, tmp_path: Path,
                                                                pattern: tuple[int, ...]) -> None:
    kinds = ["full", "sliding"]
    extra = file_store(tmp_path)
    first_prompt = prompt(100)
    request, steps = converse(gemma3_dir, extra, kinds, first_prompt, 40, pattern=pattern)
    kept = list(request.all_token_ids)
    assert kept[:100] == first_prompt and len(kept) == 140
    with_kv = min(request.num_computed_tokens, len(kept))  # the last sampled token is never fed
    assert with_kv >= 139
    saved = sorted(chunk for step in steps for plan in step.metadata.saves for chunk in plan.chunks)
    assert saved == list(range(with_kv // CHUNK))  # every full chunk once, the reply's included
    # No save plan covers a token that was a draft when it was planned.
    for step in steps:
        for plan in step.metadata.saves:
            assert list(plan.tokens) == kept[:len(plan.tokens)]

    computed, load, worker = next_turn(gemma3_dir, extra, kinds, [*kept, *prompt(10, seed=5)])
    assert computed == load.num_tokens == with_kv // CHUNK * CHUNK == 128
    assert_kept_kv(worker, load, kept)


def test_a_chunk_drafts_complete_in_a_requests_last_step_is_saved_before_its_blocks_are_freed(
        gemma3_dir: Path, tmp_path: Path) -> None:
    """Every draft right: a step computes 4 tokens; the one ending at 128 finishes the request (29 tokens
    generated), so chunk 3 is final only once it finished: vLLM keeps its blocks until the worker copied it."""
    kinds = ["full"]
    extra = file_store(tmp_path)
    request, steps = converse(gemma3_dir, extra, kinds, prompt(100), 29)
    finishing = [plan for step in steps for plan in step.metadata.saves if plan.finishing]
    assert [plan.chunks for plan in finishing] == [(3,)]
    (last,) = [index for index, step in enumerate(steps) if any(plan.finishing for plan in step.metadata.saves)]
    assert "turn" in steps[last].finished_saves  # reported in the step that copied it: vLLM frees its blocks
    kept = list(request.all_token_ids)
    computed, load, worker = next_turn(gemma3_dir, extra, kinds, [*kept, *prompt(10, seed=5)])
    assert computed == 128
    assert_kept_kv(worker, load, kept)


def test_without_save_decode_only_the_prompt_is_saved(gemma3_dir: Path, tmp_path: Path) -> None:
    kinds = ["full"]
    extra = file_store(tmp_path, save_decode=False)
    request, steps = converse(gemma3_dir, extra, kinds, prompt(100), 40, pattern=(1, 3))
    assert sorted(chunk for step in steps for plan in step.metadata.saves for chunk in plan.chunks) == [0, 1, 2]
    computed, _, _ = next_turn(gemma3_dir, extra, kinds, [*request.all_token_ids, *prompt(10, seed=5)])
    assert computed == 96


def test_decode_saves_and_their_loads_are_counted(gemma3_dir: Path, tmp_path: Path) -> None:
    kinds = ["full"]
    extra = file_store(tmp_path)
    harness, worker, model = engine(gemma3_dir, extra, kinds, seed=0, spec_tokens=0)
    harness.add("turn", prompt(100), max_tokens=40)
    steps = harness.run(worker, max_steps=200, forward=model, sampler=model)
    request_tokens = [*prompt(100), *[truth(position) for position in range(100, 140)]]
    harness.add("next", [*request_tokens, *prompt(10, seed=5)], max_tokens=1)
    steps += harness.run(worker, max_steps=200, forward=model, sampler=model)
    counters = connector_stats(steps, worker).data["counters"]
    # The reply filled chunk 3 (96-127); the second request loads it (with chunks 0-2), and saves chunk 4
    # (its prompt's tokens 128-149 and the rest) as any prompt chunk.
    assert (counters["decode_saves"], counters["decode_chunk_loads"]) == (1, 1)


# --- hybrids: recurrent states on vLLM's block grid ("align"), one state per 16 tokens ---------------------
BLOCK = 16
STATE_BYTES = sum(torch.Size(shape).numel() for shape in STATE_SHAPES) * DTYPE.itemsize  # a block's state part


def seen(tokens: int) -> int:
    """What a state block holds (every byte) after ``tokens`` tokens."""
    return tokens % 127


class HybridModel(DraftingModel):
    """The model above with a recurrent group, whose states it keeps where vLLM's model runner does in
    "align" mode: a step without drafts leaves the state after its last token in the block of that
    token; a step with drafts writes the state after each of its tokens into consecutive blocks from
    the real token's on, then copies the state at the last block boundary the accepted tokens passed
    into that boundary's block (vLLM's ``postprocess_mamba``, before the connector's save). Blocks no
    request holds are scribbled on each step, as another request's forward may write them."""

    def __call__(self, step: Step) -> None:
        scheduler = self.harness.scheduler
        self.scribble()
        super().__call__(step)
        for request_id in step.output.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            drafts = list(step.output.scheduled_spec_decode_tokens.get(request_id, []))
            end = request.num_computed_tokens
            running = end - len(drafts)  # tokens the state after the step's real tokens has seen
            for engine_group in self.worker.side.engine_groups:
                if engine_group.token_indexed:
                    continue
                ids = scheduler.kv_cache_manager.get_block_ids(request_id)[engine_group.index]
                if not drafts:
                    self.keep(engine_group.layer_names, ids, cdiv(end, BLOCK) - 1, end)
                    continue
                for offset in range(len(drafts) + 1):
                    self.keep(engine_group.layer_names, ids, (running - 1) // BLOCK + offset, running + offset)
                accepted = len(self.sample(request, drafts)) - 1
                boundary = (running + accepted) // BLOCK * BLOCK
                if boundary >= running:
                    self.keep(engine_group.layer_names, ids, boundary // BLOCK - 1, boundary)

    def keep(self, names: tuple[str, ...], ids: Sequence[int], index: int, tokens: int) -> None:
        if 0 <= index < len(ids) and ids[index]:
            for name in names:
                self.worker.caches[name][ids[index]].fill_(seen(tokens))

    def scribble(self) -> None:
        manager = self.harness.scheduler.kv_cache_manager
        held = {block for request_id in self.harness.scheduler.requests
                for ids in manager.get_block_ids(request_id) for block in ids}
        free = [block for block in range(1, self.harness.kv_cache_config.num_blocks) if block not in held]
        for caches in self.worker.caches.values():
            caches[free] = -99


def hybrid_engine(model_dir: Path, extra: dict[str, Any], *, seed: int, spec_tokens: int,
                  pattern: Sequence[int] = (SPEC_TOKENS,)) -> tuple[SchedulerHarness, FakeWorker, HybridModel]:
    kv = cache_config(["mamba", "full"], block_size=BLOCK, num_blocks=96, mamba_mode="align", spec_blocks=spec_tokens)
    settings = vllm_config(model_dir, extra, block_size=BLOCK, mamba_mode="align", prefix_caching=True,
                           spec_tokens=spec_tokens)
    harness, worker = SchedulerHarness(settings, kv), FakeWorker(settings, kv, seed=seed)
    return harness, worker, HybridModel(harness, worker, pattern)


def hybrid_next_turn(model_dir: Path, extra: dict[str, Any], tokens: list[int]) -> tuple[int, Any, FakeWorker]:
    """The next turn on a fresh engine: the tokens it loaded, its load plan and its worker."""
    harness, worker, model = hybrid_engine(model_dir, extra, seed=1, spec_tokens=0)
    harness.add("next", tokens, max_tokens=1)
    _, computed, load = harness.admit(worker, "next", forward=model)
    return computed, load, worker


def saved_entries(worker: FakeWorker) -> list[tuple[int, bool, torch.Tensor]]:
    """Record (chunk, whether a recurrent group's, entry) of every save ``worker`` queues from now on."""
    store = worker.side.store
    assert store is not None
    states = {member for group in worker.side.engine_groups if not group.token_indexed for member in group.members}
    recorded: list[tuple[int, bool, torch.Tensor]] = []
    save_chunk = store.save_chunk

    def recording(key: str, chunk: int, tensors: dict[int, torch.Tensor], **options: Any) -> Any:
        options["ready"]()  # the copies out of the caches are done: the buffers hold what is saved
        recorded.extend((chunk, member in states, tensor.clone()) for member, tensor in tensors.items())
        return save_chunk(key, chunk, tensors, **options)

    store.save_chunk = recording  # type: ignore[method-assign]
    return recorded


@pytest.mark.parametrize("pattern", [(0,), (3,), (1, 3, 0, 2, 3, 3), (2, 0)],
                         ids=["one-token-steps", "all-right", "mixed", "two-then-none"])
def test_a_hybrids_reply_is_saved_with_states_only_where_they_are_right(gemma3_dir: Path, tmp_path: Path,
                                                                       pattern: tuple[int, ...]) -> None:
    extra = file_store(tmp_path, chunk_size=None)  # a chunk: vLLM's grid of 16 tokens
    harness, worker, model = hybrid_engine(gemma3_dir, extra, seed=0, spec_tokens=SPEC_TOKENS, pattern=pattern)
    entries = saved_entries(worker)
    request = harness.add("turn", prompt(100), max_tokens=40)
    steps = harness.run(worker, max_steps=200, forward=model, sampler=model)
    assert not harness.scheduler.has_requests()
    kept = list(request.all_token_ids)
    states = [(chunk, entry) for chunk, is_state, entry in entries if is_state]
    # No state saved is another token's: each is the state after exactly its chunk's last token.
    assert states and all((entry.view(torch.int8) == seen((chunk + 1) * BLOCK)).all() for chunk, entry in states)
    with_state = {chunk for chunk, _ in states}
    saved = {chunk for step in steps for plan in step.metadata.saves for chunk in plan.chunks}
    assert saved == set(range(min(request.num_computed_tokens, len(kept)) // BLOCK))
    # The prompt's one step ends at 96, where its state is kept (chunks 0-4 have none, as without drafts).
    assert 5 in with_state and not with_state & {0, 1, 2, 3, 4}
    if pattern == (0,):  # every step computes one token: each boundary's state is where vLLM keeps it
        assert with_state == {chunk for chunk in saved if chunk >= 5}

    computed, load, next_worker = hybrid_next_turn(gemma3_dir, extra, [*kept, *prompt(10, seed=5)])
    # The hit ends at the last chunk saved with its state (every chunk before it has its K/V).
    assert computed == load.num_tokens == (max(with_state) + 1) * BLOCK
    assert_kept_kv(next_worker, load, kept)
    mamba = next(group for group in next_worker.side.engine_groups if not group.token_indexed)
    block = mamba.state_block(load.block_ids[mamba.index], load.num_tokens)
    assert all((next_worker.caches[name][block].flatten()[:STATE_BYTES] == seen(load.num_tokens)).all()
               for name in mamba.layer_names)


def test_a_hybrids_chunk_drafts_complete_in_its_last_step_is_saved_without_a_state(gemma3_dir: Path,
                                                                                   tmp_path: Path) -> None:
    """Every draft right: steps of 4 tokens from 100; the one reaching 112 finishes the request (13 tokens
    generated). Chunk 6 (96-111) is final only then: saved from the blocks vLLM keeps for it, its K/V
    only (the state after 112 is in no block the connector may read), so no hit ends there."""
    extra = file_store(tmp_path, chunk_size=None)
    harness, worker, model = hybrid_engine(gemma3_dir, extra, seed=0, spec_tokens=SPEC_TOKENS)
    entries = saved_entries(worker)
    request = harness.add("turn", prompt(100), max_tokens=13)
    steps = harness.run(worker, max_steps=200, forward=model, sampler=model)
    assert request.num_computed_tokens == 112
    (finishing,) = [plan for step in steps for plan in step.metadata.saves if plan.finishing]
    assert finishing.chunks == (6,) and not finishing.hit_ends(worker.side.engine_groups, BLOCK)
    assert sorted((chunk, is_state) for chunk, is_state, _ in entries if chunk >= 5) == [(5, False), (5, True),
                                                                                        (6, False)]
    computed, _, _ = hybrid_next_turn(gemma3_dir, extra, [*request.all_token_ids, *prompt(10, seed=5)])
    assert computed == 96
