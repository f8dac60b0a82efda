"""Bundled model configs (this package's ``*.json``, sources in ``SOURCES.tsv``) and resolving a MODEL.

A MODEL is a preset name, a path to a ``config.json``, or a model directory holding one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvgroups.errors import ModelConfigError

_PRESETS = resources.files(__name__)


@dataclass(frozen=True, kw_only=True)
class LoadedConfig:
    name: str  # preset name; a directory's name; a file's name without .json (config.json: its directory's)
    source: str  # "preset" or the file path
    config: dict[str, Any]


def preset_names() -> list[str]:
    return sorted(entry.name.removesuffix(".json") for entry in _PRESETS.iterdir() if entry.name.endswith(".json"))


def _parse(text: str, where: str) -> dict[str, Any]:
    if not text.strip():
        raise ModelConfigError(f"{where}: the file is empty; expected a Hugging Face config.json (a JSON object)")
    try:
        data = json.loads(text)  # accepts Infinity/NaN, which real configs contain
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{where}: not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{where}: a config must be a JSON object, got {type(data).__name__}")
    return data


def load_model_config(model: str) -> LoadedConfig:
    """The config of a preset name, a ``config.json`` path, or a directory holding ``config.json``."""
    if model in preset_names():
        text = (_PRESETS / f"{model}.json").read_text(encoding="utf-8")
        return LoadedConfig(name=model, source="preset", config=_parse(text, f"preset {model}"))
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{model}: directory has no config.json")
    elif not path.is_file():
        raise ModelConfigError(
            f"{model}: no such preset or file; presets: {', '.join(preset_names())}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ModelConfigError(f"{path}: cannot read: {error}") from None
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return LoadedConfig(name=name, source=str(path), config=_parse(text, str(path)))
