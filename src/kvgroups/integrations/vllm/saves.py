"""Which chunks of a request the scheduler side saves, and when: prompt and generated tokens alike.

A chunk is saved once the KV of every one of its tokens is final: computed by a forward that has run
by the time the save copies it (the save runs after its step's forward) and never to be replaced.
At a step's start, vLLM's ``num_computed_tokens`` counts the tokens computed and kept so far; the
step computes ``num_scheduled`` more, of which the speculative draft tokens
(``scheduled_spec_decode_tokens``) may be rejected, their KV then recomputed for other tokens. So
the tokens final after this step are the first ``num_computed_tokens + num_scheduled - num_drafts``,
and never more than the request's known token ids (``all_token_ids``: the prompt and the tokens
sampled or accepted so far, never a draft): a chunk is keyed by the tokens the request kept. A chunk
that accepted drafts completed is final from the next step on, and saved then (its KV stays in its
blocks); a request that finishes first keeps its blocks (vLLM's delayed free) until the worker has
copied such chunks out (``SavePlan.finishing``). A request vLLM preempts saves nothing more: its
blocks are freed at once; when it resumes, the chunks it recomputes are saved then.

A recurrent group's state is saved with a chunk only where the state after exactly the chunk's last
token is in a block (:class:`~kvgroups.integrations.vllm.plans.SavePlan`): the running state of a
step that ends at the chunk's end, or a state vLLM offers (``boundary_state_offloads``) in a block
the request holds. A step with draft tokens never ends where a chunk it saves ends (its chunks end at
its real token at the latest), so its running state, whose token depends on what is accepted, is
never taken; nor is a finished request's (vLLM may have released its block). A chunk whose state
is in no block (accepted drafts stepped past its end) is saved without it: no hit ends there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.plans import NO_RUNNING_STATE, SavePlan, token_bytes
from kvgroups.integrations.vllm.request_state import RequestState
from kvgroups.integrations.vllm.stats import ConnectorCounts
from kvgroups.store.chunks.seen import SeenEntries

logger = logging.getLogger(__name__)

BlockIds = tuple[tuple[int, ...], ...]
BlockIdsOf = Callable[[], BlockIds]  # the request's block ids now (asked only where a plan is made)


def final_tokens(request: Any, num_scheduled: int, num_drafts: int, *, save_decode: bool) -> int:
    """How many of ``request``'s first tokens have their final KV once this step's forward ran (asked
    before vLLM advances ``num_computed_tokens`` past the step); only prompt tokens without ``save_decode``."""
    known = len(request.all_token_ids) if save_decode else int(request.num_prompt_tokens)
    return min(int(request.num_computed_tokens) + num_scheduled - num_drafts, known)


class SavePlanner:
    """Each step's save plans, and the plans of requests that finished with chunks not yet saved."""

    def __init__(self, deployment: Deployment, counts: ConnectorCounts,
                 prefix_keys: Callable[[RequestState], list[str]], known: SeenEntries) -> None:
        self.deployment = deployment
        self.chunk_size = deployment.settings.chunk_size
        self.save_decode = deployment.settings.save_decode
        self.counts = counts
        self._prefix_keys = prefix_keys
        self._known = known  # keys this process knows stored (what lookups and may_load_async guess from)
        # Prefix keys of chunks holding generated tokens this server saved: a later load of one is counted.
        self.decode_saved = SeenEntries()
        self._finishing: dict[str, SavePlan] = {}  # finished requests' last saves, for the next plans

    def step(self, state: RequestState, num_scheduled: int, num_drafts: int, block_ids: BlockIdsOf,
             boundary_states: tuple[tuple[int, int, int], ...]) -> SavePlan | None:
        """The save plan of a request scheduled this step (None: nothing to save)."""
        request = state.request
        start = int(request.num_computed_tokens)
        final = final_tokens(request, num_scheduled, num_drafts, save_decode=self.save_decode)
        return self._plan(state, start, final, start + num_scheduled, block_ids, boundary_states, finishing=False)

    def finished(self, state: RequestState, block_ids: BlockIdsOf) -> SavePlan | None:
        """A request finished: the plan of chunks its last step made final that are still to be saved (in the
        next step's plans; vLLM must keep its blocks until the worker reports them copied), else None. Drafts
        accepted in its last step completed them, so no block holds a recurrent state at their ends: saved
        without."""
        request = state.request
        final = final_tokens(request, 0, 0, save_decode=self.save_decode)  # its computed tokens, as far as known
        plan = self._plan(state, final, final, NO_RUNNING_STATE, block_ids, (), finishing=True)
        if plan is not None:
            self._finishing[request.request_id] = plan
        return plan

    def take_finishing(self) -> list[SavePlan]:
        plans, self._finishing = list(self._finishing.values()), {}
        return plans

    def _plan(self, state: RequestState, start: int, final: int, step_end: int, block_ids: BlockIdsOf,
              boundary_states: tuple[tuple[int, int, int], ...], *, finishing: bool) -> SavePlan | None:
        if not self.deployment.is_producer or not state.may_save:
            return None
        # From the first chunk this step computes, or a chunk drafts completed in an earlier step.
        first = start if state.final_end is None else min(start, state.final_end)
        state.final_end = final
        chunks = tuple(chunk for chunk in range(first // self.chunk_size, final // self.chunk_size)
                       if chunk not in state.planned)
        if not chunks:
            return None
        state.see_tokens(final)
        state.planned.update(chunks)
        ids = block_ids()
        keys = self._prefix_keys(state)
        self._known.stored(keys[chunk] for chunk in chunks)
        prompt_chunks = int(state.request.num_prompt_tokens) // self.chunk_size
        generated = [keys[chunk] for chunk in chunks if chunk >= prompt_chunks]
        if generated:
            self.decode_saved.stored(generated)
            self.counts.decode_saves += len(generated)
        plan = SavePlan(
            request_id=state.request.request_id,
            token_bytes=token_bytes(state.tokens[: (chunks[-1] + 1) * self.chunk_size]),
            request_salt=state.salt, chunks=chunks, step_end=step_end, block_ids=ids,
            # Only a block the request holds now: vLLM may offer one it has already released (a boundary that
            # accepted drafts stepped past), which another request's forward may write before the save reads it.
            boundary_states=tuple((int(group), int(tokens), int(block)) for group, block, tokens in boundary_states
                                  if block and tokens % self.chunk_size == 0 and block in ids[group]),
            finishing=finishing,
        )
        self._count_stateless(plan)
        state.hit_ends.update(plan.hit_ends(self.deployment.plan.engine_groups, self.chunk_size))
        return plan

    def loaded(self, state: RequestState, num_tokens: int, local_tokens: int) -> None:
        """A load planned: count its chunks that this server saved from generated tokens."""
        keys = self._prefix_keys(state)[local_tokens // self.chunk_size:num_tokens // self.chunk_size]
        self.counts.decode_chunk_loads += self.decode_saved.held(keys)

    def _count_stateless(self, plan: SavePlan) -> None:
        """Count (and say, the first time) a hybrid's step saving no recurrent state: none of its chunks ends a hit."""
        if not plan.stores_no_state(self.deployment.plan.engine_groups, self.chunk_size):
            return
        if not self.counts.stateless_saves:
            logger.warning("KVGroupsConnector: request %s saved chunks %s without a recurrent state at any of their "
                           "ends (no block held the state after a chunk's last token: vLLM ended its step at token "
                           "%d, or accepted draft tokens stepped past the chunk's end): none of them can end a hit. "
                           "Counted in kvgroups_stateless_saves_total", plan.request_id, list(plan.chunks),
                           plan.step_end)
        self.counts.stateless_saves += 1

    def forget(self, request_id: str) -> None:
        self._finishing.pop(request_id, None)

    def clear(self) -> None:
        self._finishing.clear()
        self.decode_saved.clear()
