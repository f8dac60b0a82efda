"""Test-wide settings: Triton kernels run under Triton's interpreter where there is no GPU; the slowest modules'
tests start first."""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads this when a kernel is decorated, so it is set before kvgroups' Triton module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Modules whose tests take from twenty seconds to two minutes each (servers and engines started, a cluster failing
# over ten times, other interpreters), slowest first. Their tests are collected first, so that pytest-xdist deals
# them out to both workers at the start (--dist load) and a run never ends with one worker alone on a long test
# while the other idles. Every other test keeps its order.
SLOW_FIRST = (
    "integrations/vllm/test_pd_serve.py",
    "integrations/vllm/test_serve.py",
    "integrations/vllm/test_end_to_end.py",
    "integrations/vllm/test_hybrid_engines.py",
    "integrations/vllm/test_conversations.py",
    "integrations/vllm/test_kv_events_engine.py",
    "integrations/vllm/test_gpu_engines.py",
    "store/test_cluster.py",
    "models/test_model_type_sweep.py",
    "cli/test_generate_command.py",
    "integrations/transformers/test_restore_check.py",
    "integrations/transformers/test_reuse.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = os.path.dirname(__file__)
    rank = {os.path.join(tests, path): index for index, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))
