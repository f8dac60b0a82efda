"""The connector's tests need vLLM: they run in the environment `make test-vllm` builds (.venv-vllm)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integrations.vllm.tiny_vllm_models import save_model

    return save_model("gemma3", tmp_path_factory.mktemp("models") / "gemma3")
