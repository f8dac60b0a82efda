"""The README's ways to enable the connector are ones vLLM and the connector accept."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm.config import KVTransferConfig

from kvgroups.integrations.vllm.settings import ConnectorSettings

README = (Path(__file__).parents[2] / "README.md").read_text()


def check(config: KVTransferConfig) -> ConnectorSettings:
    module = importlib.import_module(str(config.kv_connector_module_path))
    assert getattr(module, str(config.kv_connector)).__name__ == "KVGroupsConnector"
    assert config.is_kv_producer and config.is_kv_consumer and config.kv_load_failure_policy == "recompute"
    return ConnectorSettings.from_extra_config(config.kv_connector_extra_config)


def test_the_vllm_serve_command_line() -> None:
    (block,) = re.findall(r"```sh\n(vllm serve .*?)```", README, flags=re.DOTALL)
    words = shlex.split(block)
    settings = check(KVTransferConfig(**json.loads(words[words.index("--kv-transfer-config") + 1])))
    assert settings == ConnectorSettings(stores=("file:///var/cache/kv",), chunk_size=256, salt="")


def test_the_llm_block(monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)
                if "KVGroupsConnector" in block]
    engines: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm, "LLM", lambda **arguments: engines.append(arguments))
    exec(compile(block, "README.md", "exec"), {"MODEL": "a-model"})
    (engine,) = engines
    assert check(engine["kv_transfer_config"]).stores == ("file:///var/cache/kv", "redis://cache-host:6379/0")
