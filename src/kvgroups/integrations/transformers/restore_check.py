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

A pass is remembered on disk (:mod:`.check_records`) under a fingerprint of everything the answer
depends on; a failure is never remembered: the next process checks again.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from kvgroups.integrations.transformers.cache_binding import CacheBinding
from kvgroups.integrations.transformers.check_records import CheckRecords, class_name, fingerprint
from kvgroups.models.transformers_types import sweep_data
from kvgroups.store.chunks.prefixes import LoadedEntries

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


# --- the check ---------------------------------------------------------------------------------
def _prompt(model: Any, length: int, device: torch.device) -> torch.Tensor:
    embeddings = model.get_input_embeddings()
    vocab = int(getattr(embeddings, "num_embeddings", 0) or model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(20261204)
    # Ids past the first few (often special tokens), below the vocabulary's end.
    low = min(3, vocab - 1)
    return torch.randint(low, vocab, (length,), generator=generator).to(device)


def continue_forward(model: Any, ids: torch.Tensor, cache: Any, start: int) -> Any:
    """The model's output for ``ids`` continuing ``cache`` at position ``start``, with explicit positions and
    the last position's logits: how PrefixCache computes a prompt, and the check continues one."""
    return model(input_ids=ids[None], cache=cache, use_cache=True, logits_to_keep=1,
                 position_ids=torch.arange(start, start + len(ids), device=ids.device)[None])


def _forward(model: Any, ids: torch.Tensor, cache: Any, start: int) -> torch.Tensor:
    return continue_forward(model, ids, cache, start).logits[0, -1].float()  # type: ignore[no-any-return]


def says_its_length(cache: Any) -> bool:
    """Whether ``cache`` tells ``generate`` how many tokens it holds: a cache of only linear-attention
    layers does from transformers 5.25 on (they count their tokens), and raises before."""
    try:
        cache.get_seq_length()
    except ValueError:
        return False
    return True


def feeds_last_only(cache: Any, all_recurrent: bool) -> bool:
    """Whether ``generate`` continuing ``cache`` is fed only the prompt's last token (its sequences then
    start there): where it would feed the whole prompt on top of the states."""
    return all_recurrent and not says_its_length(cache)


def continue_generate(model: Any, ids: torch.Tensor, cache: Any, all_recurrent: bool,
                      **kwargs: Any) -> tuple[Any, bool]:
    """``model.generate`` from ``cache`` holding ``ids[:-1]``, as PrefixCache.generate calls it; and whether
    only the last token was fed (:func:`feeds_last_only`)."""
    if feeds_last_only(cache, all_recurrent):
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
            records.remember(key, version, model_class, result.seconds)
            logger.info("prefix reuse on transformers %s for %s: checked, a restored prefix continues as a computed "
                        "one (%.2f s); hits are served", version, model_class, result.seconds)
        else:
            logger.warning(result.warning)
            warnings.warn(result.warning, RestoreCheckWarning, stacklevel=4)
    known[key] = result
    return result
