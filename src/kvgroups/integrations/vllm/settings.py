"""The connector's settings, read from ``kv_connector_extra_config``, and the identity of the served model.

``{"store": URL or [URLs], "chunk_size": N, "salt": S, "secret_file": PATH, "encrypt": bool,
"max_pending_bytes": N, "load_mode": "async" | "sync", "handover_wait_seconds": S, "save_decode": bool}``: where
chunks live (a list is a tier
chain, fastest first), how many tokens a stored chunk holds (a multiple of every KV-cache
group's block size; without it, the smallest such multiple of at least ``MIN_CHUNK_TOKENS``,
whatever block sizes vLLM picks at start-up, or for recurrent states on vLLM's block grid one
step of that grid), the tenant salt that keeps this deployment's keys apart from others', the
file holding the deployment's secret (else ``$KVGROUPS_STORE_SECRET``, else none), whether
entries are encrypted, the host memory queued saves may hold, and how hits are loaded: in
background threads while other requests run (``"async"``, the default), or before the forward
that needs them (``"sync"``), and how long a decode server waits for a prefill server's hand-over
(:mod:`~kvgroups.integrations.vllm.handover`), and whether the chunks a request's generated tokens fill
are saved too (``save_decode``, on by default: a conversation's next turn loads the previous reply).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import vllm
from huggingface_hub import snapshot_download

from kvgroups.core.checks import is_int_at_least
from kvgroups.core.sizes import round_up
from kvgroups.errors import KVGroupsError
from kvgroups.integrations.store_options import STORE_KEYS, read_store_options
from kvgroups.integrations.vllm.handover import DEFAULT_HANDOVER_WAIT_SECONDS
from kvgroups.store.backends.url_parts import mask_url
from kvgroups.store.chunks.chunk_store import DEFAULT_MAX_PENDING_BYTES
from kvgroups.store.entries.identity import files_digest
from kvgroups.store.entries.identity import model_identity as identity
from kvgroups.store.entries.secret import StoreSecret

KNOWN_KEYS = (*STORE_KEYS, "chunk_size", "max_pending_bytes", "load_mode", "handover_wait_seconds", "save_decode")
MAX_HANDOVER_WAIT_SECONDS = 600.0
# Without "chunk_size" a chunk is the smallest multiple of every KV-cache group's block size (vLLM
# picks a hybrid's at start-up, to fit a state in a page) holding at least this many tokens (but see
# ConnectorSettings.for_blocks for states on vLLM's block grid).
MIN_CHUNK_TOKENS = 256
FOLLOW_BLOCKS = 0  # chunk_size before it is resolved against vLLM's block sizes: none was given
LOAD_MODES = ("async", "sync")


class ConnectorConfigError(KVGroupsError):
    """``kv_connector_extra_config`` is not what the connector takes; the message says what is wrong."""


@dataclass(frozen=True)
class ConnectorSettings:
    """``stores`` may hold passwords: shown masked (repr, errors, logs)."""

    stores: tuple[str, ...] = field(repr=False)
    chunk_size: int
    salt: str
    secret: StoreSecret | None = field(default=None, compare=False)
    encrypt: bool = False
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    load_mode: str = "async"
    handover_wait_seconds: float = DEFAULT_HANDOVER_WAIT_SECONDS
    save_decode: bool = True

    @property
    def masked_stores(self) -> tuple[str, ...]:
        return tuple(mask_url(url) for url in self.stores)

    def __repr__(self) -> str:
        return (f"ConnectorSettings(stores={self.masked_stores!r}, chunk_size={self.chunk_size}, "
                f"salt=<{len(self.salt)} chars>, secret={'<set>' if self.secret else None}, encrypt={self.encrypt}, "
                f"load_mode={self.load_mode!r}, save_decode={self.save_decode})")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        problems = []
        unknown = sorted(set(extra) - set(KNOWN_KEYS))
        if unknown:
            problems.append(f"unknown keys {unknown} (known: {', '.join(KNOWN_KEYS)})")
        options = read_store_options(extra, problems)
        in_process = [url for url in options.stores if url.startswith("memory:")]
        if in_process:
            problems.append(f"'store' {in_process} lives in one process, but vLLM's scheduler and workers run "
                            f"in different processes: use file://, redis:// (a Valkey or Redis server) or redis-cluster://")
        chunk_size = extra.get("chunk_size", FOLLOW_BLOCKS)
        if "chunk_size" in extra and not is_int_at_least(chunk_size, 1):
            problems.append(f"'chunk_size' must be an int >= 1, got {chunk_size!r}")
        pending = extra.get("max_pending_bytes", DEFAULT_MAX_PENDING_BYTES)
        if not is_int_at_least(pending, 1):
            problems.append(f"'max_pending_bytes' must be an int >= 1, got {pending!r}")
        load_mode = extra.get("load_mode", "async")
        if load_mode not in LOAD_MODES:
            problems.append(f"'load_mode' must be one of {list(LOAD_MODES)}, got {load_mode!r}")
        wait = extra.get("handover_wait_seconds", DEFAULT_HANDOVER_WAIT_SECONDS)
        if type(wait) not in (int, float) or not 0 <= wait <= MAX_HANDOVER_WAIT_SECONDS:
            problems.append(f"'handover_wait_seconds' must be a number from 0 to {MAX_HANDOVER_WAIT_SECONDS:g}, "
                            f"got {wait!r}")
        save_decode = extra.get("save_decode", True)
        if not isinstance(save_decode, bool):
            problems.append(f"'save_decode' must be true or false, got {save_decode!r}")
        if problems:
            raise ConnectorConfigError("kv_connector_extra_config for KVGroupsConnector: " + "; ".join(problems))
        return cls(stores=options.stores, chunk_size=chunk_size, salt=options.salt, secret=options.secret,
                   encrypt=options.encrypt, max_pending_bytes=pending, load_mode=load_mode,
                   handover_wait_seconds=float(wait), save_decode=save_decode)

    def for_blocks(self, block_sizes: Mapping[int, int], *, states_on_block_grid: bool = False) -> ConnectorSettings:
        """These settings with the chunk size vLLM's block sizes (KV-cache group -> tokens per block) allow:
        the one given, which must be a multiple of each (else raised, with the smallest that would do),
        or without one the smallest multiple of all of them that holds ``MIN_CHUNK_TOKENS`` tokens.

        ``states_on_block_grid``: a recurrent group keeps its states on vLLM's block grid
        (``mamba_cache_mode`` "align"), where vLLM has a state only where a prefill step ended (on a
        block boundary) or that it exported there; a chunk of one grid step then ends wherever such a
        state can be, so without a chunk size given the chunk is that step, however small.
        """
        step = math.lcm(*block_sizes.values()) if block_sizes else 1
        if self.chunk_size == FOLLOW_BLOCKS:
            return replace(self, chunk_size=step if states_on_block_grid else round_up(MIN_CHUNK_TOKENS, step))
        bad = {group: size for group, size in block_sizes.items() if self.chunk_size % size}
        if bad:
            shown = ", ".join(f"group {group}: {size}" for group, size in sorted(bad.items()))
            raise ConnectorConfigError(
                f"chunk_size {self.chunk_size} must be a multiple of every KV-cache group's block size "
                f"({shown}); vLLM hands out whole blocks: the smallest chunk_size at least as large that works is "
                f"{round_up(self.chunk_size, step)}, or leave chunk_size out to follow vLLM's block sizes"
            )
        return self


def _hub_snapshot(name: str, revision: str | None) -> str | None:
    """The commit a hub model's weights were downloaded at (its cached snapshot's name), if cached."""
    try:
        return os.path.basename(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # not cached, offline, a private repo: the revision asked for names it then
        return None


def model_identity(vllm_config: Any) -> str:
    """The name a deployment's chunks are stored under (:mod:`kvgroups.store.entries.identity`'s format).

    A local model directory is identified by its name and :func:`~kvgroups.store.entries.identity.files_digest`
    (a copy on another node shares chunks, a fine-tune written over it does not); a hub name by
    the commit of its cached snapshot (else the revision asked for). The vLLM version and the
    model's dtype and quantization follow, since they change the KV bytes.
    """
    model = vllm_config.model_config
    name = str(model.model)
    if os.path.isdir(name):
        weights = f"weights-{files_digest(name)}"
        name = os.path.basename(os.path.normpath(name))
    else:
        snapshot = _hub_snapshot(name, model.revision)
        weights = f"commit-{snapshot}" if snapshot else f"revision-{model.revision or 'default'}"
    return identity(name, weights, "vllm", vllm.__version__, str(model.dtype),
                    f"quantization-{model.quantization or 'none'}")
