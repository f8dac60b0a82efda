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

from kvgroups.integrations.vllm.settings import FOLLOW_BLOCKS, ConnectorSettings
from tests.support.paths import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def claimed(test: str, language: str) -> list[str]:
    """The ``language`` blocks whose ``tested:`` marker names this file's ``test`` (at least one)."""
    marker = f"<!-- tested: tests/integrations/vllm/test_readme_vllm.py::{test} -->\n```{language}\n(.*?)```"
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


def test_the_hybrid_serve_command_line(gemma3_dir: Path) -> None:
    """docs/vllm.md's line for a hybrid: vLLM's arguments, prefix caching left at vLLM's default (on, so
    recurrent states in "align" mode), and chunk_size left out, so that chunks follow vLLM's grid of states."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvgroups.integrations.vllm.deployment import Deployment
    from tests.integrations.vllm.harness import cache_config, vllm_config

    (block,) = claimed("test_the_hybrid_serve_command_line", "sh")
    words = shlex.split(block)
    assert words[:2] == ["vllm", "serve"] and "--no-enable-prefix-caching" not in words
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    arguments = EngineArgs.from_cli_args(parser.parse_args(["--model", *words[2:]]))
    assert arguments.enable_prefix_caching in (None, True)  # vLLM's default: on
    transfer = arguments.kv_transfer_config
    assert transfer is not None
    settings = check(transfer)
    assert settings.chunk_size == FOLLOW_BLOCKS and settings.stores == ("file:///var/cache/kv",)
    # A hybrid whose blocks vLLM sized to 528 tokens (Qwen3.5 on GPUs): a chunk is one step of its grid.
    kv = cache_config(["mamba", "full"], block_size=528, num_blocks=8, mamba_mode="align")
    config = vllm_config(gemma3_dir, transfer.kv_connector_extra_config, block_size=528, mamba_mode="align",
                         prefix_caching=True)
    deployment = Deployment(config, kv)
    assert deployment.settings.chunk_size == 528 and deployment.unservable is None
