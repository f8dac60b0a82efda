"""What the sweep over every causal-LM model type of transformers found (``transformers_types.json``).

``tests/models/test_model_type_sweep.py`` builds a tiny model of each type, reads the cache a forward
leaves, and checks both ``kvgroups inspect`` (the layers it reads from the config the model saves
equal what that cache holds) and ``PrefixCache`` (a request reusing another's prefix answers as
recomputing does). It writes what it found to this file (``KVGROUPS_UPDATE_SWEEP=1``) and fails
when the file disagrees with a fresh sweep, so the file is the one source of which types are
verified and why the others are refused: ``PrefixCache`` serves exactly the verified ones, and
``kvgroups inspect`` names the reason when it refuses a type.

Each verdict is ``verified``, ``refused: <why>``, or, for inspect only, ``unchecked: <why>`` (a type
inspect reads but whose tiny model cannot run with a ``DynamicCache``, so the sweep cannot hold
its reading to a transformers cache).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvgroups.errors import KVGroupsError

DATA_FILE = "transformers_types.json"
STATUSES = ("verified", "unchecked", "refused")


@dataclass(frozen=True)
class Verdict:
    status: str  # one of STATUSES
    reason: str = ""

    @classmethod
    def parse(cls, text: str) -> Verdict:
        status, _, reason = text.partition(": ")
        if status not in STATUSES or (status == "verified") != (not reason):
            raise KVGroupsError(f"{DATA_FILE}: a verdict must be 'verified', 'unchecked: WHY' or 'refused: WHY', "
                                f"got {text!r}")
        return cls(status, reason)

    @property
    def verified(self) -> bool:
        return self.status == "verified"

    def __str__(self) -> str:
        return self.status if self.verified else f"{self.status}: {self.reason}"


@dataclass(frozen=True)
class TypeRecord:
    """One causal-LM model type: what its layers cache (the tiny model's) and the two verdicts.

    ``text_type`` is the model_type a built model answers to (its text config's): the one
    ``PrefixCache`` and ``kvgroups inspect`` look it up by.
    """

    model_type: str
    text_type: str
    cache: str
    inspect: Verdict
    prefix_cache: Verdict


@dataclass(frozen=True)
class SweepData:
    """The sweep's verdicts, written on transformers ``transformers``; ``verified_transformers`` are the
    versions the sweep and the reuse suite passed on with these verdicts (the written one among them): on
    any other, ``PrefixCache`` checks a restore before serving a hit."""

    transformers: str
    types: dict[str, TypeRecord]
    verified_transformers: frozenset[str] = frozenset()

    def prefix_cache_verdicts(self) -> dict[str, Verdict]:
        """The verdict for every name a model may answer to: each type, and each text type that is not a
        type of its own (mllama's ``mllama_text_model``), from the type it belongs to."""
        verdicts = {name: record.prefix_cache for name, record in self.types.items()}
        for record in self.types.values():
            verdicts.setdefault(record.text_type, record.prefix_cache)
        return verdicts


def parse(data: Any) -> SweepData:
    try:
        types = {
            name: TypeRecord(name, str(row["text_type"]), str(row["cache"]), Verdict.parse(row["inspect"]),
                             Verdict.parse(row["prefix_cache"]))
            for name, row in data["types"].items()
        }
        written = str(data["transformers"])
        verified = frozenset(str(version) for version in data.get("verified_transformers", [written]))
        if written not in verified:
            raise KVGroupsError(f"{DATA_FILE}: the version the sweep was written on, {written}, is not among "
                                f"verified_transformers {sorted(verified)}")
        return SweepData(written, types, verified)
    except (KeyError, TypeError, AttributeError) as error:
        raise KVGroupsError(f"{DATA_FILE} is malformed: {error!r}") from None


@functools.cache
def sweep_data() -> SweepData:
    """The shipped sweep results (read once)."""
    text = resources.files("kvgroups.models").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return parse(json.loads(text))


def inspect_refusal(model_type: str) -> str | None:
    """Why the sweep found that inspect cannot describe ``model_type``'s cache, if it did."""
    record = sweep_data().types.get(model_type)
    if record is None or record.inspect.status != "refused":
        return None
    return record.inspect.reason
