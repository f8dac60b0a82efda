"""Attention-only families with sliding-window and full layers in a pattern of their own.

Each reads a config's ``layer_types`` where it carries one (transformers writes it into every
config it saves) and otherwise derives the pattern as its ``transformers`` config class does in
``__post_init__``; a sliding layer keeps ``sliding_window`` tokens (none when the window is unset
or covers the whole context).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvgroups.core.cache_specs import FullAttention
from kvgroups.core.checks import is_int_at_least
from kvgroups.errors import ModelConfigError
from kvgroups.models.config_fields import ConfigFields, family, from_layer_types, sliding_attention
from kvgroups.models.layers import ModelLayer, NoCacheLayer

SLIDING, FULL = "sliding_attention", "full_attention"
Pattern = Callable[[ConfigFields, int, int], bool]  # (config, layer, layers) -> whether the layer slides


def _register(model_types: Iterable[str], slides: Pattern, defaults: Mapping[str, Any],
              reads: Iterable[str] = ()) -> None:
    def read(config: ConfigFields) -> list[ModelLayer]:
        layers = config.integer("num_hidden_layers")
        return from_layer_types(config, [SLIDING if slides(config, index, layers) else FULL for index in range(layers)])

    family(*model_types, defaults=defaults, reads=reads)(read)


def _every(field: str) -> Pattern:
    """Every ``field``-th layer (counting from 1) is full, the others slide."""
    def slides(config: ConfigFields, index: int, layers: int) -> bool:
        return bool((index + 1) % config.integer(field))

    return slides


def _defaults(layers: int, heads: int, hidden: int, positions: int, window: int | None, **more: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": hidden,
                             "max_position_embeddings": positions, **more}
    if window is not None:
        found["sliding_window"] = window
    return found


_register(["afmoe"], _every("global_attn_every_n_layers"),
          _defaults(32, 16, 2048, 16384, 1024, head_dim=128, global_attn_every_n_layers=4))
# Every sixth layer, and the last, is full.
_register(["beam"], lambda config, index, layers: bool((index + 1) % 6) and index != layers - 1,
          _defaults(52, 48, 5120, 8192, 512, num_key_value_heads=8, head_dim=128))
# Cohere 2 keeps its old ``sliding_window_pattern`` int (default 4) in configs on the Hub.
_register(["cohere2"], _every("sliding_window_pattern"),
          _defaults(40, 64, 8192, 8192, 4096, sliding_window_pattern=4), reads=["sliding_window_pattern"])
_register(["cohere_compass_text"], lambda config, index, layers: False, _defaults(40, 64, 8192, 8192, 4096))
_register(["cwm"], lambda config, index, layers: index % 4 != 0,
          _defaults(64, 48, 6144, 131072, 8192, num_key_value_heads=8, head_dim=128))
_register(["ergo"], _every("global_attention_every_n_layers"),
          _defaults(64, 64, 8192, 524288, 512, num_key_value_heads=8, global_attention_every_n_layers=4))
_register(["flint"], lambda config, index, layers: not (index < 2 or index % 4 == 1 or index == layers - 1),
          _defaults(49, 32, 2048, 262144, 513, num_key_value_heads=4, head_dim=128))
_register(["granite_swa"], lambda config, index, layers: index % 4 != 0,
          _defaults(24, 20, 2560, 8192, 128, num_key_value_heads=4))
_register(["granitemoe_swa"], lambda config, index, layers: index % 4 != 0, _defaults(32, 32, 4096, 2048, 128))
_register(["kolibri1"], lambda config, index, layers: bool((index + 1) % 5),
          _defaults(50, 48, 2560, 262144, 513, num_key_value_heads=4, head_dim=128))
_register(["olmo3"], lambda config, index, layers: bool((index + 1) % 4), _defaults(32, 32, 4096, 2048, 4096))
_register(["vaultgemma"], lambda config, index, layers: bool((index + 1) % 2),
          _defaults(26, 8, 2304, 8192, 4096, num_key_value_heads=4, head_dim=256))
# A sliding_window in their configs is unused unless layer_types names sliding layers.
_register(["laguna"], lambda config, index, layers: False,
          _defaults(40, 48, 2048, 131072, 512, num_key_value_heads=8, head_dim=128))
_register(["mellum"], lambda config, index, layers: False,
          _defaults(28, 32, 2304, 131072, 1024, num_key_value_heads=4, head_dim=128))
_register(["ministral"], lambda config, index, layers: True,
          _defaults(32, 32, 4096, 131072, 4096, num_key_value_heads=8))
_register(["dots1"], lambda config, index, layers: index >= config.integer("max_window_layers", minimum=0),
          _defaults(62, 32, 4608, 2048, 4096, num_key_value_heads=32, max_window_layers=62),
          reads=["max_window_layers"])


def _exaone_slides(config: ConfigFields, index: int, layers: int) -> bool:
    """Every ``sliding_window_pattern``-th layer full; without a window, none slides (EXAONE 4's rule)."""
    if config.get("sliding_window") is None:
        return False
    pattern = config.get("sliding_window_pattern")
    if not is_int_at_least(pattern, 1):
        raise ModelConfigError(f"sliding_window_pattern {pattern!r} is not a positive int and the config has no "
                               f"layer_types; transformers cannot derive the layers from it either")
    return bool((index + 1) % pattern)


_register(["exaone4", "exaone_moe"], _exaone_slides,
          _defaults(32, 32, 4096, 2048, 4096, num_key_value_heads=32, sliding_window_pattern=4),
          reads=["sliding_window_pattern"])


def _cohere2_moe_slides(config: ConfigFields, index: int, layers: int) -> bool:
    """The first ``first_k_dense_replace`` layers follow ``prefix_dense_sliding_window_pattern``, the rest
    ``sliding_window_pattern``, each counted from its own first layer."""
    prefix = config.integer("first_k_dense_replace", minimum=0)
    if index < prefix:
        return bool((index + 1) % config.integer("prefix_dense_sliding_window_pattern"))
    return bool((index - prefix + 1) % config.integer("sliding_window_pattern"))


_register(["cohere2_moe"], _cohere2_moe_slides,
          _defaults(40, 64, 8192, 8192, 4096, head_dim=128, sliding_window_pattern=4,
                    prefix_dense_sliding_window_pattern=1, first_k_dense_replace=0),
          reads=["sliding_window_pattern"])


def _smollm3_slides(config: ConfigFields, index: int, layers: int) -> bool:
    """NoPE layers (``no_rope_layers`` 0, else every ``no_rope_layer_interval``-th) slide when
    ``use_sliding_window`` is set."""
    flags = config.int_list("no_rope_layers")
    if flags is None:
        interval = config.integer("no_rope_layer_interval")
        flags = [int((layer + 1) % interval != 0) for layer in range(layers)]
    if len(flags) != layers:
        raise ModelConfigError(f"no_rope_layers has {len(flags)} entries but num_hidden_layers is {layers}")
    return config.get("use_sliding_window") is True and config.get("sliding_window") is not None and not flags[index]


_register(["smollm3"], _smollm3_slides,
          _defaults(36, 16, 2048, 32768, None, num_key_value_heads=4, no_rope_layer_interval=4,
                    use_sliding_window=False),
          reads=["no_rope_layers"])


@family("modernbert-decoder", reads_layer_types=False, defaults={
    **_defaults(22, 12, 768, 8192, None), "local_attention": 128, "global_attn_every_n_layers": 3})
def _modernbert_decoder(config: ConfigFields) -> list[ModelLayer]:
    """Every ``global_attn_every_n_layers``-th layer (from layer 0) is global; the others slide over
    ``local_attention / 2`` tokens, which transformers sets as the window whatever the config says."""
    every = config.integer("global_attn_every_n_layers")
    layers = config.integer("num_hidden_layers")
    layer_types = config.data.get("layer_types")
    if not isinstance(layer_types, list):
        layer_types = [SLIDING if index % every else FULL for index in range(layers)]
    window = config.integer("local_attention") // 2
    return from_layer_types(_with_window(config, window), layer_types)


def _with_window(config: ConfigFields, window: int) -> ConfigFields:
    data = {**config.data, "sliding_window": window}
    wrapped = ConfigFields(data, config.model_type, config.family, outer=config.outer)
    wrapped.warnings = config.warnings
    return wrapped


# Kolibri 1.1: for each indexed-attention layer, which indexed-attention layer's K/V it reads (its config class's
# default ``kv_source_layers``, by position among the indexed layers).
_KOLIBRI1_1_SOURCES = (0, 0, 0, 3, 4, 5, 5, 5, 5, 0)
_INDEXED = "indexed_attention"


@family("kolibri1_1", reads_layer_types=False,
        defaults=_defaults(50, 48, 2560, 262144, 513, num_key_value_heads=4, head_dim=128),
        # Its indexers score keys with the query heads and keep nothing: the index_ fields change no cache.
        reads=("kv_source_layers", "index_layers", "index_topk", "index_pool_size", "index_compression",
               "index_num_heads", "index_num_local_tokens", "index_num_sink_tokens"))
def _kolibri1_1(config: ConfigFields) -> list[ModelLayer]:
    """Sliding layers, and indexed-attention layers (``layer_types``; else every 5th) that attend over the whole
    context with the K/V of the indexed layer ``kv_source_layers`` names: a layer that is its own source keeps
    them, the others keep nothing."""
    count = config.integer("num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = [_INDEXED if (index + 1) % 5 == 0 else SLIDING for index in range(count)]
    if not isinstance(layer_types, list) or len(layer_types) != count or set(layer_types) - {_INDEXED, SLIDING}:
        raise ModelConfigError(f"layer_types must list {_INDEXED!r} or {SLIDING!r} for each of {count} layers, got "
                               f"{layer_types!r}")
    indexed = [index for index, kind in enumerate(layer_types) if kind == _INDEXED]
    sources = config.int_list("kv_source_layers")
    if sources is None:
        if len(indexed) > len(_KOLIBRI1_1_SOURCES):
            raise ModelConfigError(f"{len(indexed)} indexed-attention layers and no kv_source_layers: the default "
                                   f"covers {len(_KOLIBRI1_1_SOURCES)}, as transformers' does")
        sources = list(range(count))
        for layer, source in zip(indexed, _KOLIBRI1_1_SOURCES, strict=False):
            sources[layer] = indexed[source]
    if len(sources) != count:
        raise ModelConfigError(f"kv_source_layers has {len(sources)} entries for {count} layers")
    layers: list[ModelLayer] = []
    for index, kind in enumerate(layer_types):
        source = sources[index]
        if kind == SLIDING:
            if source != index:
                raise ModelConfigError(f"layer {index}: a sliding layer reads its own K/V, kv_source_layers names "
                                       f"layer {source}")
            layers.append(sliding_attention(config))
        elif source == index:
            layers.append(config.attention(FullAttention()))
        elif 0 <= source < index and layer_types[source] == _INDEXED and sources[source] == source:
            layers.append(NoCacheLayer(reason=f"reads layer {source}'s K/V"))
        else:
            raise ModelConfigError(f"layer {index}: kv_source_layers names layer {source}; expected an earlier "
                                   f"indexed-attention layer that keeps its own K/V")
    return layers
