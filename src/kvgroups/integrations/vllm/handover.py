"""Disaggregated prefill through the store: what a prefill server's response says it saved, and how a
decode server waits for it.

The routers' protocol (vLLM's P/D proxies, llm-d's sidecar): the prompt goes to a prefill server
with ``max_tokens`` 1 and ``kv_transfer_params`` ``{"do_remote_decode": true}``; the
``kv_transfer_params`` of its response go, with the same prompt, to a decode server. Here the
response's carry ``{"do_remote_prefill": true, "do_remote_decode": false, HANDOVER_KEY: {"tokens":
N, "finished_at": unix seconds, "world_size": W}}``: the prompt's first N tokens are in the store
(whole chunks, never the prompt's last token, which the decode server computes for its first
logits), under keys the decode server computes from the prompt itself, so no address is needed.
Its saves are still being written when the response leaves: the decode server's lookup asks again,
every ``HANDOVER_POLL_SECONDS``, without holding the scheduler (the request is answered "ask
again"), until N tokens are there or ``handover_wait_seconds`` passed; then it loads what is there
and computes the rest. The parameters come from a client: read defensively, and anything
malformed makes an ordinary request of it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HANDOVER_KEY = "kvgroups_handover"
# How often a decode server's lookup asks the store again while a hand-over is being written.
HANDOVER_POLL_SECONDS = 0.02
# How long a decode server waits for a hand-over's entries by default (handover_wait_seconds).
DEFAULT_HANDOVER_WAIT_SECONDS = 2.0


@dataclass(frozen=True)
class Handover:
    """A prefill server's hand-over, as its response's ``kv_transfer_params`` said it."""

    tokens: int  # the prompt's first tokens it saved
    finished_at: float  # unix seconds: when the prefill finished (for the hand-over delay)
    world_size: int  # its tensor-parallel size: every rank's chunks are keyed apart


def loadable_tokens(prompt_tokens: int, chunk_size: int) -> int:
    """The prompt's tokens a decode server may load: its whole chunks before its last token, which the decode
    server computes for its first logits."""
    return (prompt_tokens - 1) // chunk_size * chunk_size


def wants_handover(request: Any) -> bool:
    """Whether ``request`` is a P/D prefill: the decode runs elsewhere and reads what this one saves."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def handover_chunks(state: Any, known_chunks: int, chunk_size: int, engine_groups: Sequence[Any]) -> int:
    """How many whole chunks of a finished prefill request (``state``: its request_state.RequestState) the
    decode server can load: of the ``known_chunks`` from the prompt's start this server knows stored (its
    steps' saves, and before them what it saw saved or found), those up to the last chunk a hit may end at.
    A model without recurrent groups: all of them. A hybrid: up to the last chunk its steps saved with the
    states at its end, or the end of what vLLM's own cache served its first step (in "align" mode a
    boundary where vLLM keeps the states, saved with them by the request that computed it). A one-step
    prefill with vLLM's prefix cache off keeps no state on any chunk's end: 0, and the decode server
    computes the prompt without waiting for states that will never come."""
    if all(group.token_indexed for group in engine_groups):
        return known_chunks
    ends = [chunk + 1 for chunk in state.hit_ends if chunk < known_chunks]
    cached = (state.first_start or 0) // chunk_size
    return int(max([*ends, cached if cached <= known_chunks else 0]))


def handover_params(request: Any, stored_chunks: int, chunk_size: int, world_size: int) -> dict[str, Any]:
    """A P/D prefill response's ``kv_transfer_params``: the decode server loads the prompt's first
    ``stored_chunks`` whole chunks (those its steps saved, and before them those it knows stored: found
    by its lookup, or saved by an earlier request, as a system prompt vLLM's own cache served), never its
    last token."""
    usable = loadable_tokens(len(request.prompt_token_ids), chunk_size)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            HANDOVER_KEY: {"tokens": min(stored_chunks * chunk_size, usable), "finished_at": time.time(),
                           "world_size": world_size}}


def expect_handover(request: Any, prompt_tokens: int, chunk_size: int, deployment: Any,
                    counts: Any) -> HandoverWait | None:
    """A decode request's wait for what its prefill server saved, or None (no hand-over, or one this server
    cannot load: said in the log). ``deployment``: this server's (deployment.Deployment)."""
    world_size, wait_seconds = deployment.world_size, deployment.settings.handover_wait_seconds
    handover = read_handover(request, prompt_tokens)
    if handover is None:
        return None
    counts.handovers_received += 1
    if handover.world_size != world_size:
        # Each rank's chunks are keyed apart: another tensor-parallel size finds none of them.
        logger.warning("request %s: its prefill server ran %d tensor-parallel ranks, this one %d: a hand-over needs "
                       "the same size on both (each rank's chunks are its own), so nothing is waited for and the "
                       "request is served as any other", request.request_id, handover.world_size, world_size)
        return None
    return HandoverWait(handover, target=min(handover.tokens, loadable_tokens(prompt_tokens, chunk_size)),
                        deadline=time.monotonic() + wait_seconds)


def read_handover(request: Any, prompt_tokens: int) -> Handover | None:
    """The hand-over a decode request carries, or None (none, or malformed: said once in the log)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True or HANDOVER_KEY not in params:
        return None
    raw = params[HANDOVER_KEY]
    problems = []
    if not isinstance(raw, dict) or set(raw) != {"tokens", "finished_at", "world_size"}:
        problems.append("must be {'tokens': int, 'finished_at': float, 'world_size': int}")
    else:
        tokens, finished_at, world_size = raw["tokens"], raw["finished_at"], raw["world_size"]
        if type(tokens) is not int or not 0 <= tokens < max(prompt_tokens, 1):
            problems.append(f"'tokens' must be an int from 0 to the prompt's {prompt_tokens} tokens less one")
        if type(finished_at) not in (int, float) or not math.isfinite(finished_at):
            problems.append("'finished_at' must be a finite number of unix seconds")
        if type(world_size) is not int or world_size < 1:
            problems.append("'world_size' must be an int >= 1")
        if not problems:
            return Handover(tokens, float(finished_at), world_size)
    logger.warning("request %s: kv_transfer_params[%r] %s; served as a request without a hand-over",
                   getattr(request, "request_id", "?"), HANDOVER_KEY, "; ".join(problems))
    return None


@dataclass
class HandoverWait:
    """A decode request's wait for its hand-over's entries."""

    handover: Handover
    target: int  # tokens to wait for: the hand-over's, within what this prompt may load
    deadline: float  # monotonic seconds
    next_poll: float = 0.0
    settled: bool = False

    def ready(self, now: float) -> bool:
        """Whether the lookup may be asked now (else: answer "ask again" without asking the store)."""
        return now >= self.next_poll

    def settle(self, hit: int, now: float) -> bool:
        """After a lookup found ``hit`` tokens: True to serve it (all there, or the wait ran out), False to
        ask again after ``HANDOVER_POLL_SECONDS``."""
        if hit >= self.target or now >= self.deadline:
            self.settled = True
            return True
        self.next_poll = now + HANDOVER_POLL_SECONDS
        return False

    def count(self, hit: int, counts: Any) -> None:
        """The settled hand-over in the connector's counts (stats.ConnectorCounts)."""
        counts.handover_tokens += min(hit, self.target)
        counts.handover_waits_expired += hit < self.target
        counts.handover_delay_ms += max(0, round(1000 * (time.time() - self.handover.finished_at)))
