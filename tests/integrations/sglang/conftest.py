"""The SGLang backend's tests need SGLang: they run in the environment `make test-sglang` builds (.venv-sglang)."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.integrations.sglang import torchvision_stand_in

    torchvision_stand_in.install()
