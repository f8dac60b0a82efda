"""The documented ways to enable the connector (README.md, docs/vllm.md) are ones vLLM and the connector accept."""

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

ROOT = Path(__file__).parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def claimed(test: str, language: str) -> list[str]:
    """The ``language`` blocks whose ``tested:`` marker names this file's ``test`` (at least one)."""
    marker = f"<!-- tested: tests/vllm_connector/test_readme_vllm.py::{test} -->\n```{language}\n(.*?)```"
    found = [block for document in DOCUMENTS
             for block in re.findall(marker, document.read_text(), flags=re.DOTALL)]
    assert found, f"no block names {test}"
    return found


def check(config: KVTransferConfig) -> ConnectorSettings:
    module = importlib.import_module(str(config.kv_connector_module_path))
    assert getattr(module, str(config.kv_connector)).__name__ == "KVGroupsConnector"
    assert config.is_kv_producer and config.is_kv_consumer and config.kv_load_failure_policy == "recompute"
    return ConnectorSettings.from_extra_config(config.kv_connector_extra_config)


def test_the_vllm_serve_command_line() -> None:
    for block in claimed("test_the_vllm_serve_command_line", "sh"):
        words = shlex.split(block)
        settings = check(KVTransferConfig(**json.loads(words[words.index("--kv-transfer-config") + 1])))
        assert settings == ConnectorSettings(stores=("file:///var/cache/kv",), chunk_size=256, salt="")


def test_the_llm_block(monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = claimed("test_the_llm_block", "python")
    engines: list[dict[str, Any]] = []
    monkeypatch.setattr(vllm, "LLM", lambda **arguments: engines.append(arguments))
    exec(compile(block, "docs/vllm.md", "exec"), {"MODEL": "a-model"})
    (engine,) = engines
    assert check(engine["kv_transfer_config"]).stores == ("file:///var/cache/kv", "redis://cache-host:6379/0")


def test_the_kv_events_command_line() -> None:
    """docs/vllm.md's line with KV events: both configs are vLLM's, the connector's settings its own."""
    from vllm.config import KVEventsConfig

    (block,) = claimed("test_the_kv_events_command_line", "sh")
    words = shlex.split(block)
    settings = check(KVTransferConfig(**json.loads(words[words.index("--kv-transfer-config") + 1])))
    assert settings == ConnectorSettings(stores=("file:///var/cache/kv",), chunk_size=256, salt="")
    events = KVEventsConfig(**json.loads(words[words.index("--kv-events-config") + 1]))
    assert (events.enable_kv_cache_events, events.publisher, events.endpoint) == (True, "zmq", "tcp://*:5557")
    assert events.topic == "kv@$POD_IP@MODEL"  # the shell puts the pod's address there
