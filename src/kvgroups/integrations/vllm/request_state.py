"""The scheduler side's state of one request: what it may do with the store, and what was found and planned."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgroups.integrations.vllm.handover import HandoverWait

logger = logging.getLogger(__name__)


def request_options(request: Any) -> tuple[bool, bool]:
    """Whether the store may serve and may save ``request``: ``kv_transfer_params={"kvgroups": {"load":
    bool, "save": bool}}`` (both True when absent) turns either off for one request."""
    params = getattr(request, "kv_transfer_params", None)
    options = params.get("kvgroups") if isinstance(params, dict) else None
    if options is None:
        return True, True
    if not isinstance(options, dict) or set(options) - {"load", "save"} or not all(
            isinstance(value, bool) for value in options.values()):
        # Raising here would stop the engine for every request; this one just gets the defaults.
        logger.warning("request %s: kv_transfer_params['kvgroups'] must be {'load': bool, 'save': bool}, got %r; "
                       "ignored", request.request_id, options)
        return True, True
    return options.get("load", True), options.get("save", True)


@dataclass
class RequestState:
    request: Any
    tokens: np.ndarray  # its token ids as far as read (the prompt, then generated ones: see_tokens), uint32
    salt: str
    may_load: bool = True
    may_save: bool = True
    queried_local: int = 0  # the local (vLLM prefix cache) hit the lookup was asked after
    load: tuple[int, int] | None = None  # (num_tokens, local_tokens) to load in the next plan
    load_failed: bool = False  # a load of this request failed: the store is not offered again
    planned: set[int] = field(default_factory=set)  # chunks already planned for saving
    hit_ends: set[int] = field(default_factory=set)  # planned chunks a hit may end at (their states saved)
    first_start: int | None = None  # the tokens computed (vLLM's own cache, loads) when its first step began
    chunk_tiers: tuple[str, ...] = ()  # the tier serving each chunk of the stored prefix (set by its lookup)
    prefix_keys: list[str] | None = None  # rank 0's key of each full chunk of tokens, once hashed
    early: bool = False  # may_load_async answered True: its load may start while vLLM's batch is full
    early_judged: bool = False  # whether its lookup said if that guess was right (counted once)
    handover: HandoverWait | None = None  # a P/D decode request's wait for the prefill server's entries
    final_end: int | None = None  # the tokens whose KV was final after its last planned step

    def see_tokens(self, num_tokens: int) -> None:
        """Read the request's token ids (prompt and generated) up to at least ``num_tokens`` where fewer are read."""
        if len(self.tokens) < num_tokens:
            self.tokens = np.asarray(self.request.all_token_ids, dtype=np.uint32)
            self.prefix_keys = None  # hashed again, longer, when asked
