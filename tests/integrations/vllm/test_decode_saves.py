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

from kvgroups.datapath.slots import paged_slots
from tests.integrations.vllm.harness import (
    CHUNK,
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
