"""Restore checks that passed, remembered on disk under a fingerprint of what their answer depends on.

A check's answer (:mod:`.restore_check`) depends on the transformers and torch versions, the model
class, the cache's parts, dtype and chunk size, and on code: the model's module and classes, the
cache classes, ``generate``, functions set on the model's own modules and their hooks, and this
package's restore. The fingerprint digests all of it (code as bytecode, names and constants, never
an address or a string hash, so every process computes the same one): a patched method or another
release is another fingerprint, so another check. A record is a small private JSON file read
defensively: missing, too large or not for its fingerprint, it is no pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from kvgroups.integrations.transformers.cache_binding import CacheBinding
from kvgroups.integrations.transformers.reserved_layers import ReservedDynamicLayer

logger = logging.getLogger(__name__)

DIRECTORY_VARIABLE = "KVGROUPS_CACHE_DIR"  # where passes are remembered (else $XDG_CACHE_HOME/kvgroups)
MAX_RECORD_BYTES = 4096
# The modules of this package a restore runs through: their code is part of a check's fingerprint.
_OWN_MODULES = tuple(f"kvgroups.{name}" for name in (
    "integrations.transformers.cache_parts", "integrations.transformers.cache_binding",
    "integrations.transformers.reserved_layers", "integrations.transformers.restore_check",
    "integrations.transformers.check_records", "datapath.transfer"))


def class_name(model: Any) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _update_code(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _update_code(digest, constant)
        elif isinstance(constant, frozenset):  # its order follows string hashing, which differs per process
            digest.update(repr(sorted(map(repr, constant))).encode())
        else:
            digest.update(repr(constant).encode())


def _functions(namespace: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for name in sorted(namespace):
        value = namespace[name]
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        code = getattr(value, "__code__", None)
        if isinstance(code, types.CodeType):
            yield name, code


def _own_modules() -> Iterator[Any]:
    """This package's modules a restore runs through (those imported)."""
    return (sys.modules[name] for name in _OWN_MODULES if name in sys.modules)


def _own_namespaces() -> Iterator[Mapping[str, Any]]:
    """This package's modules a restore runs through, and their classes."""
    for module in _own_modules():
        yield vars(module)
        yield from (vars(value) for value in vars(module).values()
                    if isinstance(value, type) and value.__module__ == module.__name__)


def _own_constants(digest: Any) -> None:
    """The plain values this package's modules hold (TOKEN_COUNTERS, ...): set differently, another fingerprint."""
    for module in _own_modules():
        for key, value in sorted(vars(module).items()):
            if not key.startswith("__") and isinstance(value, str | int | float | tuple):
                digest.update(f"{module.__name__}.{key}={value!r}".encode())


def _instance_functions(model: Any) -> Iterator[Mapping[str, Any]]:
    """Functions set on the model's modules themselves (a forward replaced on one instance) and their hooks:
    code a class's does not show."""
    for index, module in enumerate(model.modules()):
        found = {f"{index}.{name}": getattr(value, "__func__", value) for name, value in vars(module).items()
                 if callable(value) and not isinstance(value, type)}
        for kind in ("_forward_hooks", "_forward_pre_hooks"):
            hooks = getattr(module, kind, None) or {}
            found.update({f"{index}.{kind}.{position}": getattr(hook, "__func__", hook)
                          for position, hook in enumerate(hooks.values())})
        if found:
            yield found


def _classes(model: Any, binding: CacheBinding) -> list[type]:
    cache_classes = {type(layer) for layer in DynamicCache(config=binding.config).layers}
    cache_classes |= {DynamicCache, ReservedDynamicLayer}
    generation = sys.modules.get("transformers.generation.utils")
    extra = [generation.GenerationMixin] if generation is not None else []
    return [*type(model).__mro__, *sorted(cache_classes, key=lambda cls: cls.__qualname__), *extra]


def fingerprint(model: Any, binding: CacheBinding) -> str:
    """A digest of what a check's answer depends on: versions, the model class, the cache's parts, and the
    code of the model's module, its classes, the cache classes, ``generate`` and this package's restore."""
    digest = hashlib.sha256()
    # (this package's own code is digested below, which a version number would only approximate)
    digest.update(json.dumps([transformers.__version__, torch.__version__, class_name(model),
                              str(next(model.parameters()).dtype), binding.metadata.chunk_size]).encode())
    digest.update(repr([(part.name, part.role.value, repr(part.spec), str(part.dtype), part.shape)
                        for part in binding.parts]).encode())
    seen: set[int] = set()
    module = sys.modules.get(type(model).__module__)
    namespaces: list[Mapping[str, Any]] = [vars(module)] if module is not None else []
    namespaces += [vars(cls) for cls in _classes(model, binding) if cls is not object]
    namespaces += list(_own_namespaces())
    _own_constants(digest)
    namespaces += list(_instance_functions(model))
    for namespace in namespaces:
        for name, code in _functions(namespace):
            if id(code) in seen:
                continue
            seen.add(id(code))
            digest.update(name.encode())
            _update_code(digest, code)
    return digest.hexdigest()


def records_directory() -> Path:
    configured = os.environ.get(DIRECTORY_VARIABLE)
    if configured:
        return Path(configured) / "restore-checks"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvgroups" / "restore-checks"


class CheckRecords:
    """Passes remembered on disk, one small private JSON file per fingerprint; a file that is missing,
    too large or not what this module wrote is no record (the check runs)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or records_directory()

    def passed(self, key: str) -> bool:
        path = self.directory / f"{key}.json"
        try:
            with open(path, "rb") as file:
                text = file.read(MAX_RECORD_BYTES + 1)
            record = json.loads(text) if len(text) <= MAX_RECORD_BYTES else None
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and record.get("fingerprint") == key and record.get("passed") is True

    def remember(self, key: str, transformers_version: str, model_class: str, seconds: float) -> None:
        """Write a pass; a directory that cannot be written costs the next process a check, nothing else."""
        record = {"fingerprint": key, "passed": True, "transformers": transformers_version,
                  "model_class": model_class, "seconds": round(seconds, 3)}
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary = self.directory / f".{key}.{os.getpid()}.tmp"
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                json.dump(record, file)
            os.replace(temporary, self.directory / f"{key}.json")
        except OSError as error:
            logger.debug("cannot remember a restore check in %s: %s", self.directory, error)
