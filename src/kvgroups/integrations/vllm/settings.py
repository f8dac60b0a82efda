"""The connector's settings, read from ``kv_connector_extra_config``, and the identity of the served model.

``{"store": URL or [URLs], "chunk_size": N, "salt": S}``: where chunks live (a list is a tier
chain, fastest first), how many tokens a stored chunk holds (a multiple of every attention
group's block size), and the tenant salt that keeps this deployment's keys apart from others'.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import vllm
from huggingface_hub import snapshot_download

from kvgroups.core.checks import is_int_at_least
from kvgroups.errors import KVGroupsError

KNOWN_KEYS = ("store", "chunk_size", "salt")
DEFAULT_CHUNK_SIZE = 256
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# A weight file stands for itself by its size and this many evenly spaced samples of its bytes:
# reading whole files would take minutes for a large model, while a fine-tune changes nearly
# every block (so a sample sees it) and a copy on another node has the same bytes (so its engines
# share chunks; names, paths and modification times would keep them apart).
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 4096


class ConnectorConfigError(KVGroupsError):
    """``kv_connector_extra_config`` is not what the connector takes; the message says what is wrong."""


@dataclass(frozen=True)
class ConnectorSettings:
    stores: tuple[str, ...]
    chunk_size: int
    salt: str

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        problems = []
        unknown = sorted(set(extra) - set(KNOWN_KEYS))
        if unknown:
            problems.append(f"unknown keys {unknown} (known: {', '.join(KNOWN_KEYS)})")
        store = extra.get("store")
        urls = [store] if isinstance(store, str) else store
        if not isinstance(urls, (list, tuple)) or not urls or not all(isinstance(url, str) and url for url in urls):
            problems.append(f"'store' must be a store URL or a non-empty list of them, got {store!r}")
            urls = []
        in_process = [url for url in urls if url.startswith("memory:")]
        if in_process:
            problems.append(f"'store' {in_process} lives in one process, but vLLM's scheduler and workers run "
                            f"in different processes: use file:// or redis:// (valkey://)")
        chunk_size = extra.get("chunk_size", DEFAULT_CHUNK_SIZE)
        if not is_int_at_least(chunk_size, 1):
            problems.append(f"'chunk_size' must be an int >= 1, got {chunk_size!r}")
        salt = extra.get("salt", "")
        if not isinstance(salt, str):
            problems.append(f"'salt' must be a str, got {type(salt).__name__}")
        if problems:
            raise ConnectorConfigError("kv_connector_extra_config for KVGroupsConnector: " + "; ".join(problems))
        return cls(stores=tuple(urls), chunk_size=chunk_size, salt=salt)

    def check_block_sizes(self, block_sizes: Mapping[int, int]) -> None:
        """Raise unless ``chunk_size`` is a multiple of every attention group's block size (group -> size)."""
        bad = {group: size for group, size in block_sizes.items() if self.chunk_size % size}
        if bad:
            shown = ", ".join(f"group {group}: {size}" for group, size in sorted(bad.items()))
            raise ConnectorConfigError(
                f"chunk_size {self.chunk_size} must be a multiple of every attention group's block size "
                f"({shown}); vLLM hands out whole blocks"
            )


def _weights_digest(directory: str) -> str:
    """SHA-256 of config.json and of every weight file's relative name, size and sampled bytes."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if name == "config.json":
                with open(path, "rb") as handle:
                    digest.update(b"config:" + handle.read())
            elif name.endswith(_WEIGHT_SUFFIXES):
                size = os.path.getsize(path)
                digest.update(f"{relative}:{size}:".encode())
                last = max(size - _SAMPLE_BYTES, 0)
                with open(path, "rb") as handle:
                    for sample in range(_SAMPLES_PER_FILE):
                        handle.seek(last * sample // (_SAMPLES_PER_FILE - 1))
                        digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def _hub_snapshot(name: str, revision: str | None) -> str | None:
    """The commit a hub model's weights were downloaded at (its cached snapshot's name), if cached."""
    try:
        return os.path.basename(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception:  # not cached, offline, a private repo: the revision asked for names it then
        return None


def model_identity(vllm_config: Any) -> str:
    """The name a deployment's chunks are stored under: the model, its weights, and what computes its KV.

    A local model directory is identified by its name, its config and its weight files (sizes and
    sampled bytes, not paths or times: a copy on another node shares chunks, a fine-tune written
    over it does not); a hub name by the commit of its cached snapshot (else the revision asked
    for). The vLLM version and the model's dtype and quantization enter too, since they change
    the KV bytes.
    """
    model = vllm_config.model_config
    name = str(model.model)
    if os.path.isdir(name):
        weights = f"weights-{_weights_digest(name)}"
        name = os.path.basename(os.path.normpath(name))
    else:
        snapshot = _hub_snapshot(name, model.revision)
        weights = f"commit-{snapshot}" if snapshot else f"revision-{model.revision or 'default'}"
    version = ".".join(vllm.__version__.split(".")[:2])
    return f"{name}|{weights}|vllm-{version}|{model.dtype}|quantization-{model.quantization or 'none'}"
