"""Every family's defaults are the ``transformers`` config class's: a config that omits a field is read
as transformers builds the model (a ``num_key_value_heads`` of 4 where the class says 4, not the query
heads). Fields a family names in ``aliases`` are compared under the class's own spelling."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvgroups.models.configs import FAMILIES

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402


def class_defaults(model_type: str) -> dict[str, Any]:
    cls = CONFIG_MAPPING[model_type]
    return {field.name: field.default for field in dataclasses.fields(cls)
            if field.default is not dataclasses.MISSING}


@pytest.mark.parametrize("model_type", sorted(name for name in FAMILIES if name in CONFIG_MAPPING))
def test_family_defaults_are_the_config_class_defaults(model_type: str) -> None:
    family = FAMILIES[model_type]
    defaults = class_defaults(model_type)
    differ = {}
    for name, ours in family.defaults.items():
        field = family.aliases.get(name, name)
        if field in defaults and defaults[field] is not None and defaults[field] != ours:
            differ[name] = (ours, defaults[field])
    assert not differ, f"{model_type}: ours vs transformers' {differ}"
