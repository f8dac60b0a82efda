"""Every causal-LM model type of the installed transformers: ``kvgroups inspect`` and ``PrefixCache``
verified against the cache the type's model keeps, or refused with the reason (issue 20).

One test runs the sweep (:mod:`tests.support.model_type_sweep`) in this process and compares what it finds
with ``src/kvgroups/models/transformers_types.json``, the file ``PrefixCache`` and ``kvgroups
inspect`` read their verdicts from; ``KVGROUPS_UPDATE_SWEEP=1`` rewrites that file and the docs
table from the sweep instead. The other tests read only the file.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.paths import ROOT

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvgroups import ModelConfigError  # noqa: E402
from kvgroups.integrations.transformers import REFUSED_MODEL_TYPES, VERIFIED_MODEL_TYPES  # noqa: E402
from kvgroups.models.configs import model_spec_from_config  # noqa: E402
from kvgroups.models.transformers_types import parse  # noqa: E402
from tests.support.model_type_docs import README_COUNTS, counts, render_table  # noqa: E402
from tests.support.model_type_recipes import TEXT_OF  # noqa: E402
from tests.support.model_type_sweep import (  # noqa: E402
    INSPECT_REFUSED,
    PREFIX_REASONS,
    causal_types,
    sweep,
    to_record,
)

DATA = ROOT / "src" / "kvgroups" / "models" / "transformers_types.json"
DOCS = ROOT / "docs" / "model-types.md"
# Verified before the sweep existed: none may regress.
VERIFIED_BEFORE = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text",
                   "deepseek_v3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bamba", "falcon_h1", "nemotron_h",
                   "granitemoehybrid", "zamba2", "mamba2", "lfm2"}


def stored() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA.read_text(encoding="utf-8"))
    return data


@pytest.fixture
def quiet_single_thread() -> Iterator[None]:
    """One torch thread (the machine's other core runs the other pytest worker), denormals flushed (random
    tiny models make them, and they slow some models' forwards 2-3x on this CPU), transformers quiet."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)
    torch.set_flush_denormal(False)
    torch.set_num_threads(threads)


def _differences(found: dict[str, Any], kept: dict[str, Any]) -> list[str]:
    lines = [f"transformers {kept.get('transformers')} -> {found['transformers']}"] if (
        found["transformers"] != kept.get("transformers")) else []
    if found["verified_transformers"] != kept.get("verified_transformers"):
        lines.append(f"verified_transformers {kept.get('verified_transformers')} -> {found['verified_transformers']}")
    for name in sorted(set(found["types"]) | set(kept.get("types", {}))):
        now, before = found["types"].get(name), kept.get("types", {}).get(name)
        if now != before:
            lines.append(f"{name}: file {before} -> sweep {now}")
    return lines


def with_verified_versions(record: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the versions the file says were verified, this one among them: a version is added by
    the run that writes the file on it, and stays while the verdicts do (the reuse suite runs on the oldest
    locked one in make test, tests/test_transformers_versions.py)."""
    versions = set(kept.get("verified_transformers", [])) | {record["transformers"]}
    return {**record, "verified_transformers": sorted(versions, key=lambda text: [int(part) if part.isdigit() else 0
                                                                                   for part in text.split(".")])}


@pytest.mark.usefixtures("quiet_single_thread")
def test_every_causal_lm_type_is_verified_or_refused_with_the_reason() -> None:
    record = with_verified_versions(to_record(sweep()), stored())
    if os.environ.get("KVGROUPS_UPDATE_SWEEP"):
        DATA.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        DOCS.write_text(render_table(parse(record)), encoding="utf-8")
    differences = _differences(record, stored())
    assert not differences, ("the sweep disagrees with src/kvgroups/models/transformers_types.json (rerun with "
                             "KVGROUPS_UPDATE_SWEEP=1 if the change is right):\n" + "\n".join(differences))
    data = parse(record)
    # Exactly the types without a reader are refused by inspect, each with the reason written for it; every
    # reader is verified against the cache (or unchecked where its tiny model cannot run with a DynamicCache).
    refused = {name: row.inspect.reason for name, row in data.types.items() if row.inspect.status == "refused"}
    assert refused == {**INSPECT_REFUSED, **{composite: INSPECT_REFUSED[text] for composite, text in TEXT_OF.items()
                                             if text in INSPECT_REFUSED}}
    # Every explanation still explains a failure.
    assert all(not data.types[name].prefix_cache.verified for name in PREFIX_REASONS)
    assert {name for name, row in data.types.items() if row.prefix_cache.verified} >= VERIFIED_BEFORE


def test_the_file_covers_every_causal_lm_type_of_the_installed_transformers() -> None:
    data = parse(stored())
    assert data.transformers == transformers.__version__
    assert transformers.__version__ in data.verified_transformers
    assert sorted(data.types) == causal_types()
    assert set(INSPECT_REFUSED) <= set(data.types) and set(PREFIX_REASONS) <= set(data.types)


def test_prefix_cache_and_inspect_take_their_verdicts_from_the_file() -> None:
    data = parse(stored())
    verdicts = data.prefix_cache_verdicts()
    assert {name for name, verdict in verdicts.items() if verdict.verified} == VERIFIED_MODEL_TYPES
    assert {name: verdict.reason for name, verdict in verdicts.items() if not verdict.verified} == REFUSED_MODEL_TYPES
    assert VERIFIED_BEFORE <= VERIFIED_MODEL_TYPES
    assert "mllama_text_model" in VERIFIED_MODEL_TYPES  # what MllamaForCausalLM answers to
    for name, row in data.types.items():
        if row.inspect.status == "refused":
            pattern = rf"model_type {name!r} is not supported \({re.escape(row.inspect.reason)}\)"
            with pytest.raises(ModelConfigError, match=pattern):
                model_spec_from_config({"model_type": name, "num_hidden_layers": 2, "num_attention_heads": 2,
                                        "hidden_size": 64})


def test_the_docs_table_and_the_readme_counts_are_the_file() -> None:
    data = parse(stored())
    assert DOCS.read_text(encoding="utf-8") == render_table(data)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    counted = README_COUNTS.format(**counts(data))
    assert counted in " ".join(readme.split())
