"""Compressed-attention families (DeepSeek-V4 Flash and Pro): per layer a sliding K=V window, and on the
compressed layers one row per ``compress_ratio`` tokens (:mod:`kvgroups.models.compressed_layers`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgroups.errors import ModelConfigError
from kvgroups.models.compressed_layers import CSA_RATIO, CompressedAttentionLayer, CompressedSourceLayer
from kvgroups.models.config_fields import ConfigFields, family
from kvgroups.models.layers import ModelLayer

# transformers' DeepseekV4Config: its layer types and their default rates.
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
_DEFAULT_RATES = {CSA: 4, HCA: 128}
_READS = ("compress_ratios", "compress_rates", "compress_rate_csa", "compress_rate_hca", "layer_types",
          "sliding_window", "head_dim", "qk_rope_head_dim", "index_head_dim", "index_n_heads", "index_topk")


def _rates(config: ConfigFields) -> dict[str, int]:
    rates = dict(_DEFAULT_RATES)
    given = config.get("compress_rates")
    if given is not None and not isinstance(given, Mapping):
        raise ModelConfigError(f"compress_rates must map layer types to ratios, got {given!r}")
    rates.update(given or {})
    for layer_type, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if config.get(legacy) is not None:
            rates[layer_type] = config.get(legacy)
    return rates


def compress_ratios(config: ConfigFields) -> list[tuple[int, bool]]:
    """Each decoder layer's compress ratio (1 for a window-only layer) and whether it runs CSA: from
    ``layer_types`` and ``compress_rates`` (transformers' form) or the released configs' ``compress_ratios``
    (one entry per layer and one per multi-token-prediction layer after them, which keep no cache here; 0 is
    window only; 4 is CSA, as vLLM reads them)."""
    layers = config.integer("num_hidden_layers")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        rates = _rates(config)
        unknown = sorted({str(kind) for kind in layer_types} - {CSA, HCA, SLIDING})
        if unknown or len(layer_types) != layers:
            raise ModelConfigError(f"layer_types must list one of {SLIDING}, {CSA}, {HCA} for each of {layers} "
                                   f"layers, got {len(layer_types)} entries{f' with {unknown}' if unknown else ''}")
        ratios: list[Any] = [1 if kind == SLIDING else rates[kind] for kind in layer_types]
        sparse = [kind == CSA for kind in layer_types]
    else:
        given = config.get("compress_ratios")
        if not isinstance(given, list) or len(given) < layers:
            raise ModelConfigError(f"compress_ratios must list a ratio for each of the {layers} layers (and the "
                                   f"multi-token-prediction layers after them), got {given!r}")
        ratios = [max(1, ratio) if isinstance(ratio, int) and not isinstance(ratio, bool) else ratio
                  for ratio in given[:layers]]
        sparse = [ratio == CSA_RATIO for ratio in ratios]
    bad = [(index, ratio) for index, ratio in enumerate(ratios)
           if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1]
    if bad:
        raise ModelConfigError(f"compress ratios must be ints >= 0; layers {[index for index, _ in bad]} have "
                               f"{[ratio for _, ratio in bad]}")
    return list(zip(ratios, sparse, strict=True))


@family("deepseek_v4", defaults={"num_hidden_layers": 43, "num_attention_heads": 64, "hidden_size": 4096,
                                 "max_position_embeddings": 1048576, "sliding_window": 128, "head_dim": 512,
                                 "qk_rope_head_dim": 64, "index_head_dim": 128},
        reads=_READS, reads_layer_types=False)
def _deepseek_v4(config: ConfigFields) -> list[ModelLayer]:
    """Every layer a window of one shared K=V head; compressed layers (ratio > 1) their rows besides."""
    head_dim, window = config.integer("head_dim"), config.integer("sliding_window")
    rope = config.get("qk_rope_head_dim")
    if rope is None:
        rope = int(head_dim * float(config.get("partial_rotary_factor", 0.125)))
    index_head_dim = config.integer("index_head_dim")
    return [CompressedAttentionLayer(head_dim=head_dim, rope_dim=int(rope), window_tokens=window, compress_ratio=ratio,
                                     index_head_dim=index_head_dim, sparse=sparse)
            for ratio, sparse in compress_ratios(config)]


_V41_READS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "sliding_window", "head_dim",
              "qk_rope_head_dim", "index_head_dim", "index_n_heads", "index_topk")


def _layer_ids(config: ConfigFields, name: str, layers: int) -> set[int]:
    ids = config.get(name)
    if not isinstance(ids, list) or any(not isinstance(index, int) or not 0 <= index < layers for index in ids):
        raise ModelConfigError(f"{name} must list layer numbers below {layers}, got {ids!r}")
    return set(ids)


@family("deepseek_v41", "deepseek_v41_text", defaults={"num_attention_heads": 64, "hidden_size": 5120,
                                                       "sliding_window": 128, "head_dim": 512, "qk_rope_head_dim": 64,
                                                       "index_head_dim": 128},
        reads=_V41_READS, reads_layer_types=False)
def _deepseek_v41(config: ConfigFields) -> list[ModelLayer]:
    """DeepSeek-V4.1: ``compress_ratios`` 0 (window only), 2 or 1 per layer (the entries after the layers are the
    multi-token-prediction layers'); only the ``kv_source_layer_ids`` own compressed KV, the others read the
    latest source's; the ``index_source_layer_ids`` among them own indexer keys (vLLM's reading)."""
    layers = config.integer("num_hidden_layers")
    ratios = config.get("compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < layers or any(ratio not in (0, 1, 2) for ratio in ratios[:layers]):
        raise ModelConfigError(f"compress_ratios must give each of the {layers} layers 0, 1 or 2, got {ratios!r}")
    kv_sources = _layer_ids(config, "kv_source_layer_ids", layers)
    index_sources = _layer_ids(config, "index_source_layer_ids", layers)
    head_dim, rope = config.integer("head_dim"), config.integer("qk_rope_head_dim")
    return [CompressedSourceLayer(head_dim=head_dim, rope_dim=rope, window_tokens=config.integer("sliding_window"),
                                  compress_ratio=ratios[index], kv_source=index in kv_sources,
                                  index_source=index in index_sources, index_head_dim=config.integer("index_head_dim"))
            for index in range(layers)]
