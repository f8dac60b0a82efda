"""Shared helpers for the tests."""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import torch

from kvgroups.models.presets import load_model_config, preset_names
from tests.support.paths import CONFIGS

# Fixtures read as they are, except the ones kept to be refused.
REFUSED_FIXTURES = ("falcon-h1-0.5b",)


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor that has a shape and dtype but no storage."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def fixture_names() -> list[str]:
    return sorted(path.stem for path in CONFIGS.glob("*.json"))


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return data


def falcon_h1_small() -> dict[str, Any]:
    """Falcon-H1-0.5B with the mamba_d_ssm its transcription lacks (24 heads x 64)."""
    return {**fixture("falcon-h1-0.5b"), "mamba_d_ssm": 1536}


def every_config() -> dict[str, dict[str, Any]]:
    """Every bundled preset and every fixture that reads, by name (fixtures as ``fixture:NAME``)."""
    configs = {name: copy.deepcopy(load_model_config(name).config) for name in preset_names()}
    configs.update({f"fixture:{name}": fixture(name) for name in fixture_names() if name not in REFUSED_FIXTURES})
    configs["fixture:falcon-h1-0.5b+mamba_d_ssm"] = falcon_h1_small()
    return configs


class Pending:
    """A completion (a CUDA event, as far as the code waiting on it can tell) that is done only once the
    test sets ``done``: copies still queued on a stream."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait(10)
