"""The connector's scheduler side: how many tokens the store can serve a request, and each step's plans.

A hit is promised from what exists (:meth:`KVChunkStore.lookup` on every rank's chunks, no body
read; :mod:`~kvgroups.integrations.vllm.lookups` runs it in the background where the store is a
server), so the scheduler never waits on entries' bytes. The worker reads and checks each entry
once, when it loads; an entry gone or corrupt by then fails the load and vLLM recomputes the
request (asynchronous loads, ``failed_recving``) or the blocks (synchronous loads,
``invalid_block_ids``), and the store is not offered for that request again. A hit never covers
the prompt's last token (vLLM computes it for the first logits) and is a multiple of the chunk
size, itself a multiple of every KV-cache group's block size.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from typing import Any

import numpy as np

from kvgroups.integrations.vllm.deployment import Deployment
from kvgroups.integrations.vllm.events import StoreEvents
from kvgroups.integrations.vllm.handover import expect_handover, handover_chunks, handover_params, wants_handover
from kvgroups.integrations.vllm.lookups import KnownPrefixes, Lookups, all_tiers_local
from kvgroups.integrations.vllm.plans import KVGroupsConnectorMetadata, LoadPlan, request_salt, token_bytes
from kvgroups.integrations.vllm.request_state import RequestState, request_options
from kvgroups.integrations.vllm.saves import SavePlanner
from kvgroups.integrations.vllm.stats import ConnectorCounts, StatsReporter
from kvgroups.store.backends.urls import open_store
from kvgroups.store.chunks.chunk_store import KVChunkStore

logger = logging.getLogger(__name__)


class SchedulerSide:
    """Lookups against every rank's chunks, load and save plans, per-request state."""

    def __init__(self, deployment: Deployment, kv_cache_config: Any = None, cache_config: Any = None) -> None:
        self.deployment = deployment
        # vLLM's cache config, whose block size its scheduler ends "align"-mode prefill steps on; it must stay
        # the recurrent groups' (keep_state_grid).
        self._cache_config = cache_config
        self._state_grid = next((group.block_size for group in deployment.plan.engine_groups
                                 if group.states_on_block_grid), None)
        self.chunk_size = deployment.settings.chunk_size
        self.store = open_store(list(deployment.settings.stores))
        self.rank_stores = [
            KVChunkStore(deployment.metadata(rank, deployment.groups, "scheduler"), self.store,
                         salt=deployment.settings.salt, secret=deployment.settings.secret)
            for rank in range(deployment.world_size)
        ]
        self._requests: dict[str, RequestState] = {}
        self._kv_cache_manager: Any = None
        self.asynchronous = deployment.load_asynchronously
        self.lookups = Lookups(background=not all_tiers_local(deployment.settings.stores))
        self.known = KnownPrefixes()  # what may_load_async guesses from
        self._async_loads: list[str] = []  # requests whose asynchronous load the next plan starts
        self._generation = ""  # after a reset (new weights), a salt of this process's own in every key
        self._tier_names = [tier.tier_name for tier in self.store.tiers]  # fastest first
        # vLLM's log line and /metrics get the lookups of rank 0's chunks (every rank is asked the same).
        self.counts = ConnectorCounts()
        self.stats = StatsReporter(self.rank_stores[0].stats, self.counts)
        self.events = StoreEvents(deployment, self.rank_stores, kv_cache_config) if deployment.kv_events else None
        self.saves = SavePlanner(deployment, self.counts, self._prefix_keys, self.known)
        if deployment.unservable:
            logger.warning("KVGroupsConnector will save chunks but serve no hits: %s", deployment.unservable)
        if deployment.sparse_states:
            logger.warning(
                "KVGroupsConnector: chunk_size %d is longer than vLLM's grid of recurrent states (mamba_cache_mode "
                "'align', one state per %s tokens at most, where a prefill step ends): a chunk's state is stored "
                "only where a step ends on its boundary, so few prefixes hit. Leave chunk_size out to follow vLLM's "
                "grid", self.chunk_size, "/".join(str(group.block_size) for group in deployment.plan.engine_groups
                                                  if group.states_on_block_grid))

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        if self.events is not None:
            self.events.bind_block_pool(getattr(kv_cache_manager, "block_pool", None))

    # --- lookups ----------------------------------------------------------------------------
    def _state_of(self, request: Any) -> RequestState | None:
        state = self._requests.get(request.request_id)
        if state is None:
            salt = request_salt(request)
            if salt is None:
                return None
            salt += self._generation
            may_load, may_save = request_options(request)
            state = RequestState(request, np.asarray(request.prompt_token_ids, dtype=np.uint32), salt,
                               may_load=may_load, may_save=may_save)
            self._requests[request.request_id] = state
            if self.deployment.is_consumer:
                state.handover = expect_handover(request, len(state.tokens), self.chunk_size, self.deployment,
                                                 self.counts)
        return state

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store serves, and whether they load asynchronously;
        None while the request's lookup runs in the background (vLLM asks again next step)."""
        self.keep_state_grid()  # (asked before the scheduler cuts a request's first step)
        state = self._state_of(request)
        if (state is None or not state.may_load or state.load_failed or not self.deployment.is_consumer
                or self.deployment.unservable):
            return 0, False
        state.see_tokens(len(request.all_token_ids))  # a request vLLM preempted resumes with its generated tokens
        usable = (len(state.tokens) - 1) // self.chunk_size * self.chunk_size
        if usable <= num_computed_tokens:
            return 0, False
        wait = state.handover
        if wait is not None and not wait.settled and not wait.ready(time.monotonic()):
            return None, False
        hit = self.lookups.answer(request.request_id, lambda: self._stored_hit(state, usable))
        if hit is None:
            return None, False
        if wait is not None and not wait.settled:
            if not wait.settle(hit, time.monotonic()):  # its prefill server's saves are still being written
                self.lookups.forget(request.request_id)
                return None, False
            wait.count(hit, self.counts)
        state.queried_local = num_computed_tokens
        new_tokens = max(0, hit - num_computed_tokens)
        if state.early and not state.early_judged:
            state.early_judged = True
            self.counts.early_load_misses += new_tokens == 0
        return new_tokens, new_tokens > 0 and self.asynchronous

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34's question for every request entering its waiting queues: may its load start while the
        running batch is full (``--max-num-inflight-kv-loads``)? True for a P/D transfer, and where the
        store likely holds more of the prompt than vLLM's own prefix cache: its lookup's answer if known,
        else the prefix keys this process saw stored (hashes and a dictionary: no store is asked here). A
        request answered False waits for a slot as any other; one answered True wrongly holds back other
        early loads until a slot frees (counted: kvgroups_early_load_misses_total)."""
        if not (self.asynchronous and self.deployment.is_consumer) or self.deployment.unservable:
            return False
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            return True
        state = self._state_of(request)
        if state is None or not state.may_load or state.load_failed:
            return False
        usable = (len(state.tokens) - 1) // self.chunk_size
        if not usable:
            return False
        self.lookups.start(request.request_id, lambda: self._stored_hit(state, usable * self.chunk_size))
        known = self.lookups.known(request.request_id)
        stored = known if known is not None else (
            self.known.depth(self._prefix_keys(state)[:usable]) * self.chunk_size)
        likely = stored > self._locally_cached(request)
        if likely and not state.early:
            state.early = True
            self.counts.early_loads += 1
        return likely

    def _locally_cached(self, request: Any) -> int:
        """Tokens of ``request`` vLLM's own prefix cache holds now (a probe, no block taken; 0 before 0.34)."""
        probe = getattr(self._kv_cache_manager, "get_num_cached_tokens", None)
        return int(probe(request)) if probe is not None else 0

    def _prefix_keys(self, state: RequestState) -> list[str]:
        """Rank 0's key of every full chunk of the request's tokens read so far, hashed once per length."""
        if state.prefix_keys is None:
            state.prefix_keys = self.rank_stores[0].keys(state.tokens, request_salt=state.salt)
        return state.prefix_keys

    def _stored_hit(self, state: RequestState, usable: int) -> int:
        """The longest boundary every rank's entries exist at (none is read: the worker checks them)."""
        tokens = state.tokens[:usable]
        # Each rank's own groups under its keys; groups every rank holds alike under rank 0's.
        found = [store.locate(None, keys=self._prefix_keys(state)[:usable // self.chunk_size] if rank == 0
                              else store.keys(tokens, request_salt=state.salt), groups=owned)
                 for rank, store in enumerate(self.rank_stores) if (owned := self.deployment.owned_groups(rank))]
        hit = min(prefix.num_tokens for prefix in found)
        self.known.add(self._prefix_keys(state)[:hit // self.chunk_size])
        # A chunk is as slow as the slowest tier any rank reads it from.
        state.chunk_tiers = tuple(max((prefix.chunk_tiers[chunk] for prefix in found), key=self._tier_names.index)
                                  for chunk in range(hit // self.chunk_size))
        logger.debug("request %s: store holds %d of %d prompt tokens", state.request.request_id, hit,
                     len(state.tokens))
        return hit

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        # vLLM calls this again, with 0, when an asynchronous load is done: nothing more to plan.
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        state.load = (state.queried_local + num_external_tokens, state.queried_local)
        self.saves.loaded(state, *state.load)
        if state.queried_local:  # local hit, then the store, then compute
            self.counts.continued(state.queried_local, num_external_tokens)
        if self.asynchronous:
            self._async_loads.append(request.request_id)

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        """The tier name serving each of a request's ``num_external_tokens`` (after its local hit), summed per tier."""
        state = self._requests.get(request.request_id)
        first = state.queried_local if state is not None else 0
        end = first + num_external_tokens
        sources: dict[str, int] = {}
        for chunk in range(first // self.chunk_size, -(-end // self.chunk_size)):
            tokens = min((chunk + 1) * self.chunk_size, end) - max(chunk * self.chunk_size, first)
            tier = state.chunk_tiers[chunk] if state is not None and chunk < len(state.chunk_tiers) else ""
            sources[tier] = sources.get(tier, 0) + tokens
        return sources

    def loads_failed(self, request_ids: set[str]) -> None:
        """Loads that failed (``failed_recving``): vLLM recomputes these requests; never offer them the store again."""
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                state.load_failed = True
                logger.info("request %s: its stored prefix failed to load; recomputed", request_id)

    # --- plans ------------------------------------------------------------------------------
    def build_meta(self, scheduler_output: Any) -> KVGroupsConnectorMetadata:
        self.keep_state_grid()
        metadata = KVGroupsConnectorMetadata(idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        # Asynchronous loads are not scheduled this step (their requests wait for them): each plan
        # carries its blocks.
        for request_id in self._async_loads:
            state = self._requests.get(request_id)
            if state is None or state.load is None:
                continue
            metadata.loads.append(self._load_plan(request_id, state, self._block_ids(request_id), asynchronous=True))
        self._async_loads.clear()
        # In mamba_cache_mode "align" vLLM hands over the blocks holding the states it keeps at block
        # boundaries this step (request -> (group, block, tokens)): a chunk's state is taken from there.
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        boundary_states = getattr(block_state, "boundary_state_offloads", None) or {}
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        metadata.saves.extend(self.saves.take_finishing())  # requests that finished with chunks still to save
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(request_id)
            if state is None:
                continue
            # Called before the scheduler advances num_computed_tokens: this step starts here.
            start = int(state.request.num_computed_tokens)
            state.first_start = start if state.first_start is None else state.first_start
            if state.load is not None:
                metadata.loads.append(self._load_plan(request_id, state, self._block_ids(request_id),
                                                      asynchronous=False))
            plan = self.saves.step(state, int(num_scheduled), len(drafts.get(request_id, ())),
                                   functools.partial(self._block_ids, request_id), boundary_states.get(request_id, ()))
            if plan is None:
                continue
            metadata.saves.append(plan)
            if self.events is not None:
                self.events.saving(state.request, plan)
        if self.events is not None:
            for load in metadata.loads:
                self.events.loading(self._requests[load.request_id].request, load)
        return metadata

    def keep_state_grid(self) -> None:
        """Put vLLM's ``cache_config.block_size`` back to the recurrent groups' block size where it differs.

        In ``mamba_cache_mode`` "align" vLLM's scheduler ends prefill steps, and keeps states, on
        ``cache_config.block_size`` (``Scheduler._mamba_block_aligned_split``). vLLM resolves it to the
        hybrid's block size (384 for a qwen3-next-like model), but its engine-core process
        (``EngineCoreProc``, as under ``vllm serve`` or ``LLM`` with multiprocessing) runs
        ``VllmConfig.__post_init__`` again after its handshake, once the scheduler holds the config, and
        there the CPU platform resets a block size the user did not set to 128: steps then end off the
        states' grid, and no chunk's state is ever kept (vLLM 0.32). The in-process engine keeps 384."""
        config = self._cache_config
        if config is None or self._state_grid is None or config.block_size == self._state_grid:
            return
        logger.warning("KVGroupsConnector: vLLM's cache_config.block_size is %s in the scheduler's process, but its "
                       "recurrent states are kept every %d tokens; set back to %d so that prefill steps end where "
                       "states are kept", config.block_size, self._state_grid, self._state_grid)
        config.block_size = self._state_grid

    def update(self, connector_output: Any) -> None:
        """A step's results: failed loads are not offered the store again; events learn what was written."""
        failed = getattr(connector_output, "failed_recving", None)
        if failed:
            self.loads_failed(set(failed))
        if self.events is not None:
            self.events.update(connector_output)

    @staticmethod
    def _load_plan(request_id: str, state: RequestState, block_ids: tuple[tuple[int, ...], ...], *,
                   asynchronous: bool) -> LoadPlan:
        num_tokens, local_tokens = state.load or (0, 0)
        state.load = None
        return LoadPlan(request_id=request_id, token_bytes=token_bytes(state.tokens[:num_tokens]),
                        request_salt=state.salt, num_tokens=num_tokens, local_tokens=local_tokens,
                        block_ids=block_ids, asynchronous=asynchronous)

    def _block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(block) for block in ids) for ids in self._kv_cache_manager.get_block_ids(request_id))

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Its blocks can be freed at once (saves copied them out in their step; a load
        still running holds them through vLLM until the worker reports it), unless chunks its last step
        made final are still to be saved: then True, and vLLM keeps them until the worker reports that save."""
        state = self._requests.pop(request.request_id, None)
        self.lookups.forget(request.request_id)
        if self.events is not None:
            self.events.forget(request.request_id)
        last = self.saves.finished(state, functools.partial(self._block_ids, request.request_id)) if state else None
        if last is not None and self.events is not None:
            self.events.saving(request, last)
        delay_free = last is not None
        if not wants_handover(request):
            return delay_free, None
        self.counts.handovers_sent += 1
        stored = 0 if state is None else handover_chunks(state, self.known.depth(self._prefix_keys(state)),
                                                         self.chunk_size, self.deployment.plan.engine_groups)
        return delay_free, handover_params(request, stored, self.chunk_size, self.deployment.world_size)

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update: what the store
        holds may come from other weights, so this server never serves it again. Its keys move to a
        new generation, a random salt of this process (never shared: two servers updated alike cost
        each other hits, never answers), and every request's state and lookup is forgotten."""
        self._generation = "\0generation " + secrets.token_hex(16)
        for request_id in self._requests:
            self.lookups.forget(request_id)
        self._requests.clear()
        self._async_loads.clear()
        self.known.clear()
        self.saves.clear()
        if self.events is not None:
            self.events.reset()
        logger.warning("KVGroupsConnector: prefix cache reset; chunks stored before are not served by this server")
        return True

    def close(self) -> None:
        self.lookups.close()
        for store in self.rank_stores:
            store.close()
        self.store.close()
