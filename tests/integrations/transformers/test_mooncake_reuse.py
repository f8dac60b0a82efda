"""PrefixCache on a Mooncake Store pool (a store test more than a transformers one: not in the oldest-transformers
stage, which reruns tests/integrations/transformers/test_reuse.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from kvgroups.integrations.transformers import PrefixCache  # noqa: E402
from tests.integrations.transformers.test_reuse import (  # noqa: E402
    CHUNK,
    assert_same_answer,
    in_process,
    prompts,
    stored_model,
)
from tests.support.mooncake import lending_client, running_master  # noqa: E402


def test_a_mooncake_pool_serves_a_hybrids_prefix_another_process_computed(tmp_path: Path) -> None:
    """PrefixCache on a Mooncake Store tier behind a memory tier: another process computes and stores (its
    recurrent states too) into memory a third process lends the pool; this one reuses it, the answer the
    recomputed one."""
    model_dir = stored_model(tmp_path, "qwen3_next")
    first, second = prompts()
    with running_master(tmp_path / "master") as master, lending_client(master.url(segment="128MiB")):
        pool = master.url(segment="0")
        assert in_process(model_dir, pool, first)[0] == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        with PrefixCache(model, ["memory://?max_bytes=64MiB", pool], chunk_size=CHUNK) as cache:
            result = cache.prefill(second)
            assert result.reused_tokens == 24
            assert cache.chunk_store.stats.hit_tokens_by_tier.get("mooncake") == 24
            assert_same_answer(model, cache, second, result.logits)
