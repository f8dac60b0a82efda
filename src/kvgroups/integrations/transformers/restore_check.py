"""The check before a hit on a transformers version the sweep never verified.

transformers' cache layers are internals that change between releases (5.25 made linear-attention
layers count their own tokens, and a restore that did not set the count made hybrids answer
differently). On a version the sweep verified (``VERIFIED_TRANSFORMERS``, data in the package) a
restore is known right for every verified model type. On any other, :func:`check_restore` holds a
restored prefix to a computed one on the model itself before its first hit: one chunk of a seeded
prompt is computed and packed, then continued two ways, on the live cache (computed) and on a fresh
cache restored from the packed chunk (every group, a hybrid's conv and recurrent states included):
the suffix's logits and ``DECODE_STEPS`` greedy steps of ``generate`` after it must agree. Both
ways do the same arithmetic on the same bytes, so the tolerance is float noise.

A pass is remembered on disk (:class:`CheckRecords`) under a fingerprint of everything the answer
depends on: the versions, the model class, the cache's parts, and the code of the model's module,
of the cache classes and of ``generate`` (a patched method is another fingerprint, so another check).
A failure is never remembered: the next process checks again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from kvgroups.integrations.transformers.cache_binding import CacheBinding
from kvgroups.integrations.transformers.reserved_layers import ReservedDynamicLayer
from kvgroups.models.transformers_types import sweep_data
from kvgroups.store.prefixes import LoadedEntries

logger = logging.getLogger(__name__)

# The versions of transformers the sweep verified reuse on (src/kvgroups/models/transformers_types.json).
VERIFIED_TRANSFORMERS = sweep_data().verified_transformers
DECODE_STEPS = 4
SUFFIX_TOKENS = 4  # the prompt's tokens after the restored chunk: 3 in the suffix's forward, 1 fed by generate
# The largest difference allowed, relative to the computed logits' scale (at least 1): float noise of the
# same arithmetic on tensors laid out differently, in the model's dtype.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
HALF_TOLERANCE = 2e-2
CHECK_VARIABLE = "KVGROUPS_RESTORE_CHECK"  # "0" turns the check off, as restore_check=False does
DIRECTORY_VARIABLE = "KVGROUPS_CACHE_DIR"  # where passes are remembered (else $XDG_CACHE_HOME/kvgroups)
MAX_RECORD_BYTES = 4096
# The modules of this package a restore runs through: their code is part of a check's fingerprint.
_OWN_MODULES = tuple(f"kvgroups.{name}" for name in (
    "integrations.transformers.cache_parts", "integrations.transformers.cache_binding",
    "integrations.transformers.reserved_layers", "integrations.transformers.restore_check", "datapath.transfer"))


class RestoreCheckWarning(UserWarning):
    """A restored prefix did not continue as a computed one on this transformers version: no hits are served."""


@dataclass(frozen=True)
class RestoreCheck:
    """What the check found: ``passed``, what differed when it did not, the seconds it took (0 when a
    remembered pass was read), and whether the pass was read from disk."""

    transformers_version: str
    model_class: str
    passed: bool
    difference: str = ""
    seconds: float = 0.0
    remembered: bool = False

    @property
    def warning(self) -> str:
        """What a failed check warns: the version, the model class, what differed."""
        return (f"prefix reuse is off for {self.model_class}: transformers {self.transformers_version} is a version "
                f"kvgroups never verified (verified: {', '.join(sorted(VERIFIED_TRANSFORMERS))}), and on it a "
                f"restored prefix does not continue as a computed one ({self.difference}); every request computes "
                f"its whole prompt")


def needs_check(version: str) -> bool:
    return version not in VERIFIED_TRANSFORMERS


def check_enabled(option: bool | None) -> bool:
    """The check runs unless the option or ``$KVGROUPS_RESTORE_CHECK=0`` turns it off (the option wins)."""
    if option is not None:
        return option
    return os.environ.get(CHECK_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def class_name(model: Any) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


# --- the check ---------------------------------------------------------------------------------
def _prompt(model: Any, length: int, device: torch.device) -> torch.Tensor:
    embeddings = model.get_input_embeddings()
    vocab = int(getattr(embeddings, "num_embeddings", 0) or model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(20261204)
    # Ids past the first few (often special tokens), below the vocabulary's end.
    low = min(3, vocab - 1)
    return torch.randint(low, vocab, (length,), generator=generator).to(device)


def _forward(model: Any, ids: torch.Tensor, cache: Any, start: int) -> torch.Tensor:
    """The last position's logits of ``ids`` continuing ``cache`` at position ``start`` (as PrefixCache runs)."""
    end = start + len(ids)
    output = model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=1,
                   position_ids=torch.arange(start, end, device=ids.device)[None])
    return output.logits[0, -1].float()  # type: ignore[no-any-return]


def says_its_length(cache: Any) -> bool:
    """Whether ``cache`` tells ``generate`` how many tokens it holds: a cache of only linear-attention
    layers does from transformers 5.25 on (they count their tokens), and raises before."""
    try:
        cache.get_seq_length()
    except ValueError:
        return False
    return True


def continue_generate(model: Any, ids: torch.Tensor, cache: Any, all_recurrent: bool,
                      **kwargs: Any) -> tuple[Any, bool]:
    """``model.generate`` from ``cache`` holding ``ids[:-1]``, as PrefixCache.generate calls it; and whether
    only the last token was fed (its sequences then start there)."""
    if all_recurrent and not says_its_length(cache):
        # generate would feed the whole prompt on top of the state: hand it only the token not cached.
        return model.generate(ids[None, -1:], cache=cache, **kwargs), True
    return model.generate(ids[None], cache=cache, **kwargs), False


def _steps(model: Any, ids: torch.Tensor, cache: Any, all_recurrent: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The logits and tokens of ``DECODE_STEPS`` greedy steps after ``ids`` from ``cache``."""
    output, _ = continue_generate(model, ids, cache, all_recurrent, max_new_tokens=DECODE_STEPS,
                                  min_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
    tokens = [int(token) for token in output.sequences[0, -len(output.logits):]]
    return [logits[0].float() for logits in output.logits], tokens


def _differs(what: str, computed: torch.Tensor, restored: torch.Tensor, tolerance: float) -> str:
    if computed.shape != restored.shape:
        return f"{what}: logits of shape {list(restored.shape)} where computing gives {list(computed.shape)}"
    scale = max(1.0, float(computed.abs().max()))
    difference = float((computed - restored).abs().max())
    if not difference <= tolerance * scale:  # (a NaN differs)
        return f"{what}: logits differ from computing by {difference:.3g} (allowed {tolerance * scale:.3g})"
    return ""


def _compare(computed: tuple[torch.Tensor, list[torch.Tensor], list[int]],
             restored: tuple[torch.Tensor, list[torch.Tensor], list[int]], tolerance: float) -> str:
    suffix = _differs("the suffix's forward", computed[0], restored[0], tolerance)
    if suffix:
        return suffix
    for step, (ours, theirs) in enumerate(zip(computed[1], restored[1], strict=False), 1):
        step_difference = _differs(f"decode step {step}", ours, theirs, tolerance)
        if step_difference:
            return step_difference
    if computed[2] != restored[2]:
        return f"greedy decoding chose tokens {restored[2]} where computing chooses {computed[2]}"
    return ""


def check_restore(model: Any, binding: CacheBinding) -> tuple[bool, str]:
    """Whether a prefix restored through ``binding`` continues exactly as the computed one, and if not
    what differed (or what raised)."""
    chunk = binding.metadata.chunk_size
    device = binding.device
    ids = _prompt(model, chunk + SUFFIX_TOKENS, device)
    dtype = next(model.parameters()).dtype
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    with torch.no_grad():
        try:
            live = DynamicCache(config=model.config)
            _forward(model, ids[:chunk], live, 0)
            packed = [tensor.clone() for tensor in binding.bind(live, chunk).pack(0, chunk)]
            computed_logits = _forward(model, ids[chunk:-1], live, chunk)
            computed = (computed_logits, *_steps(model, ids, live, binding.all_recurrent))
        except Exception as error:  # the model's own path: nothing to compare against
            return False, f"computing the check's prompt raised {type(error).__name__}: {error}"
        try:
            entries = {(group, 0): tensor for group, tensor in enumerate(packed)}
            loaded = LoadedEntries(num_tokens=chunk, entries=entries)
            cache = binding.restore(loaded, capacity_tokens=len(ids) - 1)
            restored_logits = _forward(model, ids[chunk:-1], cache, chunk)
            restored = (restored_logits, *_steps(model, ids, cache, binding.all_recurrent))
        except Exception as error:  # a restored cache the new release does not take is a failed check
            return False, f"continuing a restored cache raised {type(error).__name__}: {error}"
    difference = _compare(computed, restored, tolerance)
    return not difference, difference


# --- remembering passes ------------------------------------------------------------------------
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


def _own_namespaces() -> Iterator[Mapping[str, Any]]:
    """This package's modules a restore runs through, and their classes."""
    for name in _OWN_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        yield vars(module)
        yield from (vars(value) for value in vars(module).values()
                    if isinstance(value, type) and value.__module__ == name)


def _own_constants(digest: Any) -> None:
    """The plain values this package's modules hold (TOKEN_COUNTERS, ...): set differently, another fingerprint."""
    for name in _OWN_MODULES:
        module = sys.modules.get(name)
        for key, value in sorted(vars(module).items()) if module is not None else ():
            if not key.startswith("__") and isinstance(value, str | int | float | tuple):
                digest.update(f"{name}.{key}={value!r}".encode())


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

    def remember(self, key: str, check: RestoreCheck) -> None:
        """Write a pass; a directory that cannot be written costs the next process a check, nothing else."""
        record = {"fingerprint": key, "passed": True, "transformers": check.transformers_version,
                  "model_class": check.model_class, "seconds": round(check.seconds, 3)}
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary = self.directory / f".{key}.{os.getpid()}.tmp"
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                json.dump(record, file)
            os.replace(temporary, self.directory / f"{key}.json")
        except OSError as error:
            logger.debug("cannot remember a restore check in %s: %s", self.directory, error)


# The checks this process ran or read, per model object and fingerprint: once per process and model (a model
# whose modules were patched on the instance is another model, though its class and code are the same).
_CHECKED: weakref.WeakKeyDictionary[Any, dict[str, RestoreCheck]] = weakref.WeakKeyDictionary()


def checked(model: Any, binding: CacheBinding, records: CheckRecords | None = None,
            run: Callable[[Any, CacheBinding], tuple[bool, str]] = check_restore) -> RestoreCheck:
    """The check for ``model`` on the installed transformers: from this process's memory, from a pass on
    disk, or run now (a pass then written to disk). A failure warns once, naming the version, the model
    class and what differed; a pass is logged."""
    version, model_class = transformers.__version__, class_name(model)
    key = fingerprint(model, binding)
    known = _CHECKED.setdefault(model, {})
    if key in known:
        return known[key]
    records = records or CheckRecords()
    if records.passed(key):
        result = RestoreCheck(version, model_class, passed=True, remembered=True)
        logger.info("prefix reuse on transformers %s for %s: a restored prefix was checked to continue as a "
                    "computed one (remembered in %s)", version, model_class, records.directory)
    else:
        begin = time.perf_counter()
        passed, difference = run(model, binding)
        result = RestoreCheck(version, model_class, passed, difference, time.perf_counter() - begin)
        if passed:
            records.remember(key, result)
            logger.info("prefix reuse on transformers %s for %s: checked, a restored prefix continues as a computed "
                        "one (%.2f s); hits are served", version, model_class, result.seconds)
        else:
            logger.warning(result.warning)
            warnings.warn(result.warning, RestoreCheckWarning, stacklevel=4)
    known[key] = result
    return result
