"""A model's identity in the store: the name its chunks are stored under, from its weights wherever they are.

One format for every engine: ``{name}|{weights}|{engine}-{major.minor}[|{fact}...]``, where
``weights`` is ``weights-{digest}`` (32 hex digits of a SHA-256 over sampled weight bytes) or, for
a hub model known only by name, ``commit-{sha}`` / ``revision-{name}``; then the engine's version
and any fact that changes the KV bytes (dtype, quantization). The digest's two sources, tensors in
memory (:func:`tensors_digest`) and files on disk (:func:`files_digest`), read a few MiB whatever
the model's size (why that tells fine-tunes apart and lets copies share: docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

import torch

SAMPLE_BYTES = 4096
SAMPLES_PER_FILE = 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_DIGEST_HEX_DIGITS = 32


def tensors_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The weights digest of tensors in memory (a model's named parameters and buffers)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        digest.update(f"{name}:{list(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        count = max(1, SAMPLE_BYTES // flat.element_size())
        for piece in (flat[:count], flat[-count:]):
            digest.update(piece.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:_DIGEST_HEX_DIGITS]


def files_digest(directory: str) -> str:
    """The weights digest of a model directory: its config and sampled bytes of its weight files."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if name == "config.json":
                with open(path, "rb") as handle:
                    digest.update(b"config:" + handle.read())
            elif name.endswith(WEIGHT_SUFFIXES):
                size = os.path.getsize(path)
                digest.update(f"{relative}:{size}:".encode())
                last = max(size - SAMPLE_BYTES, 0)
                with open(path, "rb") as handle:
                    for sample in range(SAMPLES_PER_FILE):
                        handle.seek(last * sample // (SAMPLES_PER_FILE - 1))
                        digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:_DIGEST_HEX_DIGITS]


def model_identity(name: str, weights: str, engine: str, version: str, *facts: str) -> str:
    """``{name}|{weights}|{engine}-{major.minor}[|{fact}...]``; ``version`` is cut to major.minor."""
    major_minor = ".".join(version.split(".")[:2])
    return "|".join((name, weights, f"{engine}-{major_minor}", *facts))
