"""Hybrids under vLLM's defaults: prefix caching on, so recurrent states on vLLM's block grid ("align").

Each engine runs in a fresh process, greedy with logprobs, with ``chunk_size`` left out (so one
step of vLLM's grid). Three engines run the same phases: one without the connector, one that
stores, and a fresh one that reuses what the second stored. The phases are chosen so that every
state the store serves was computed along the same steps as the engine without the connector
computed it, so tokens and logprobs must be equal, not merely close:

- ``a``: the first ``SHARED`` tokens of ``x`` and a few of its own; vLLM keeps the state at
  ``SHARED`` (its last block boundary), the store saves it; the fresh engine loads it.
- ``x``: vLLM's own prefix cache serves its first ``SHARED`` tokens (``a`` left them), the store
  the rest to ``x``'s last block boundary (the fresh engine), then the engine computes.
- ``z``: a prompt of its own, served from the store alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.engine_runner import outputs, run_job
from tests.integrations.vllm.tiny_vllm_models import save_model


def prompt(seed: int, length: int) -> list[int]:
    return [4 + (index * 37 + seed * 101 + 11) % 508 for index in range(length)]


def cached(phase: dict[str, Any]) -> list[int]:
    return [output["num_cached_tokens"] for output in phase["outputs"]]


def continued(phases: list[dict[str, Any]], index: int) -> tuple[int, int, int]:
    """The connector's counts of local-then-store hits during phase ``index``."""
    before = phases[index - 1]["connector_counts"] if index else {}
    after = phases[index]["connector_counts"]
    names = ("continued_hits", "continued_local_tokens", "continued_store_tokens")
    hits, local, store = (after[name] - before.get(name, 0) for name in names)
    return hits, local, store


# kind, vLLM's block size on this CPU (one state per block), tokens a and x share, the job's own settings.
MODELS = {
    # Gated DeltaNet + full attention (Qwen3-Next, Qwen3.5): bfloat16 only; states pinned to float32 and
    # attention to vLLM's vec kernels, so that every x86 CPU runs the same engine.
    "qwen3_next": (288, 576, {"dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32",
                              "cpu_attention_kernels": "vec"}),
    # Mamba-2 + attention (Granite 4, Nemotron-H): vLLM's CPU build fails on Mamba-2's prefill checkpoint
    # export under prefix caching, so it runs without it (the scheduler then stops a step there).
    "granite_hybrid": (32, 512, {"dtype": "float32", "mamba2_checkpoint_export": False}),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_hybrid_under_vllms_defaults_reuses_states_and_continues_vllms_own_hits(kind: str,
                                                                                   tmp_path: Path) -> None:
    block, shared, settings = MODELS[kind]
    model = str(save_model(kind, tmp_path / kind))
    store_dir = tmp_path / "kv"
    job = {"model": model, "prefix_caching": True, "store_dir": str(store_dir),
           "connector": {"store": f"file://{store_dir}"}, **settings}
    x = prompt(5, 1000)
    a, z = x[:shared] + prompt(9, 10), prompt(7, 700)
    phases = [{"requests": [{"prompt_token_ids": tokens}]} for tokens in (a, x, z)]
    baseline = run_job({**job, "connector": None, "phases": phases}, tmp_path, "baseline", multiprocess=False)
    first = run_job({**job, "phases": phases}, tmp_path, "first", multiprocess=False)
    assert {phase["block_size"] for phase in baseline + first} == {block}
    last_boundary = (len(x) - 1) // block * block
    # The storing engine: vLLM's own cache serves x's shared tokens, the store nothing yet.
    assert [cached(phase) for phase in baseline] == [[0], [shared], [0]]
    assert [cached(phase) for phase in first] == [[0], [shared], [0]]
    assert [outputs(phase) for phase in first] == [outputs(phase) for phase in baseline]
    # a's chunks and its state at `shared`, x's to its last boundary, z's to its own: states where steps ended.
    stored = [set(phase["store_keys"]) for phase in first]
    assert len(stored[0]) == shared // block + 1  # every chunk's K/V, the state at its end
    assert len(stored[1] - stored[0]) == (last_boundary - shared) // block + 1

    second = run_job({**job, "phases": phases}, tmp_path, "second", multiprocess=False)
    assert [outputs(phase) for phase in second] == [outputs(phase) for phase in baseline]
    # a from the store; x: vLLM's own cache (a's loaded blocks) to `shared`, the store on to x's last block
    # boundary; z from the store alone.
    assert [cached(phase) for phase in second] == [[shared], [last_boundary], [(len(z) - 1) // block * block]]
    assert [continued(second, index) for index in range(3)] == [
        (0, 0, 0), (1, shared, last_boundary - shared), (0, 0, 0)]
