"""Reading a model family's config: field access with the family's defaults, and the family registry.

Fields and defaults follow the ``transformers`` config classes (the authority on defaults), read
without importing them. Each family registers one :class:`Family` by ``model_type``
(:func:`family`): its reader, its defaults, how it reads a config's ``layer_types`` list
(which entries it knows beyond the attention kinds, or that its reader interprets the list
itself), and which of the fields that change what layers cache (:func:`changes_the_cache`) it
reads. A config carrying such a field that its family does not read is refused rather than
guessed at (:func:`unread_cache_fields`). Adding a family touches only its own registration, in
:mod:`kvgroups.models.families`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgroups.core.cache_specs import ChunkedLocal, FullAttention, LayerCacheSpec, SlidingWindow
from kvgroups.core.checks import is_int_at_least
from kvgroups.errors import ModelConfigError
from kvgroups.models.layers import AttentionLayer, ModelLayer, NoCacheLayer

GENERIC_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size")
# Where configs name their SSM states' dtype (mamba2 hybrids; Qwen3-Next and Qwen3.5), first found wins.
SSM_DTYPE_FIELDS = ("mamba_ssm_cache_dtype", "mamba_ssm_dtype")

# Fields that change what a model's layers cache (recurrent mixers, layer patterns, other head
# counts or sizes, image tokens, sparse-attention indexers, latents). Only families that read
# them accept them.
_CACHE_FIELD_PREFIXES = ("mamba_", "ssm_", "linear_", "hybrid_", "swa_", "index_", "attn_layer_", "conv_")
_CACHE_FIELD_SUFFIXES = ("layer_pattern",)
_CACHE_FIELDS = frozenset({
    "cross_attention_layers", "kv_lora_rank", "qk_rope_head_dim", "attn_type_list", "layers_block_type",
    "full_attn_idxs", "global_head_dim", "num_global_key_value_heads", "num_kv_shared_layers", "n_mamba_heads",
    "n_groups", "block_configs", "attention_chunk_size", "no_rope_layers", "sliding_window_pattern",
    "max_window_layers", "v_head_dim", "indexer_types",
})


def changes_the_cache(name: str) -> bool:
    """Whether a config field of this name changes what the model's layers cache."""
    return name in _CACHE_FIELDS or name.startswith(_CACHE_FIELD_PREFIXES) or name.endswith(_CACHE_FIELD_SUFFIXES)


def _is_set(value: Any) -> bool:
    """A value that says something (null, false, 0 and empty lists leave a field unused)."""
    return value is not None and value is not False and value != 0 and value not in ("", [], {})


class ConfigFields:
    """Field access with the family's defaults and errors that name the missing field."""

    def __init__(self, data: Mapping[str, Any], model_type: str, family: Family,
                 outer: Mapping[str, Any] | None = None) -> None:
        self.data = data  # the text model's config
        self.outer = data if outer is None else outer  # the whole config (multimodal: with vision_config)
        self.model_type = model_type
        self.family = family
        self.defaults = family.defaults
        self.warnings: list[str] = []

    def warn(self, message: str) -> None:
        """Note something the reader assumed; it reaches the user on stderr and in ``warnings``."""
        if message not in self.warnings:
            self.warnings.append(message)

    def get(self, name: str, fallback: Any = None) -> Any:
        """A field by its usual name; a family that spells it otherwise (GPT-2's ``n_layer``, a
        decoder's ``decoder_layers``) names its own spelling in ``aliases``, which wins."""
        alias = self.family.aliases.get(name)
        value = self.data.get(alias) if alias is not None else None
        if value is None:
            value = self.data.get(name)
        if value is None:
            value = self.defaults.get(name, fallback)
        return value

    def integer(self, name: str, *, minimum: int = 1) -> int:
        value = self.get(name)
        if value is None:
            raise ModelConfigError(f"config (model_type {self.model_type!r}) lacks field {name!r}")
        if not is_int_at_least(value, minimum):
            raise ModelConfigError(
                f"config field {name!r} must be an int >= {minimum}, got {value!r} "
                f"(model_type {self.model_type!r})"
            )
        return value

    def require(self, *names: str) -> None:
        missing = [name for name in names if self.get(name) is None]
        if missing:
            raise ModelConfigError(
                f"config (model_type {self.model_type!r}) lacks fields {missing}"
            )

    def head_size(self, *names: str) -> int:
        """The first of ``names`` (default ``head_dim``) set, else hidden_size / num_attention_heads."""
        for name in names or ("head_dim",):
            if self.get(name) is not None:
                return self.integer(name)
        hidden, heads = self.integer("hidden_size"), self.integer("num_attention_heads")
        if hidden % heads:
            raise ModelConfigError(
                f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} and no "
                f"head_dim is set (model_type {self.model_type!r})"
            )
        return hidden // heads

    def num_kv_heads(self) -> int:
        if self.get("num_key_value_heads") is None:
            return self.integer("num_attention_heads")
        return self.integer("num_key_value_heads")

    def int_list(self, name: str, *, minimum: int = 0) -> list[int] | None:
        """A list of ints (layer indices, flags), or None when the field is not set."""
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, list) or not all(is_int_at_least(item, minimum) for item in value):
            raise ModelConfigError(
                f"config field {name!r} must be a list of ints >= {minimum}, got {value!r} "
                f"(model_type {self.model_type!r})"
            )
        return value

    def layer_indices(self, name: str) -> set[int]:
        """A field listing layer numbers, each checked against num_hidden_layers."""
        indices = self.int_list(name) or []
        num_layers = self.integer("num_hidden_layers")
        outside = sorted(index for index in indices if index >= num_layers)
        if outside:
            raise ModelConfigError(f"{name} lists layers {outside} but num_hidden_layers is {num_layers}")
        return set(indices)

    def sliding_window(self) -> int | None:
        """The window when set, not disabled and smaller than the longest context."""
        window = self.get("sliding_window")
        if window is None or self.get("use_sliding_window") is False:
            return None
        if not is_int_at_least(window, 1):
            raise ModelConfigError(f"sliding_window must be a positive int or null, got {window!r}")
        max_positions = self.get("max_position_embeddings")
        if isinstance(max_positions, int) and window >= max_positions:
            return None  # the window covers every position the model can see
        return window

    def attention(self, spec: LayerCacheSpec, *head_size_fields: str) -> AttentionLayer:
        return AttentionLayer(spec=spec, num_kv_heads=self.num_kv_heads(), head_size=self.head_size(*head_size_fields))


Reader = Callable[[ConfigFields], list[ModelLayer]]
LayerReader = Callable[[ConfigFields], ModelLayer]


def sliding_attention(config: ConfigFields) -> ModelLayer:
    """Attention over the config's ``sliding_window`` (the whole context where it has none)."""
    window = config.sliding_window()
    return config.attention(SlidingWindow(window_tokens=window) if window else FullAttention())


# The ``layer_types`` entries every family that uses the list shares.
_ATTENTION_TYPES: dict[str, LayerReader] = {
    "full_attention": lambda config: config.attention(FullAttention()),
    "sliding_attention": sliding_attention,
    "chunked_attention": lambda config: config.attention(
        ChunkedLocal(chunk_tokens=config.integer("attention_chunk_size"))
    ),
}


@dataclass(frozen=True, kw_only=True)
class Family:
    """How one family's configs are read.

    ``read`` builds the layers from the family's own fields; when a config carries a
    ``layer_types`` list and ``reads_layer_types`` is set, the list decides instead, entry by
    entry, with the attention kinds plus the family's ``layer_types`` readers.
    """

    read: Reader
    defaults: Mapping[str, Any] = field(default_factory=dict)
    layer_types: Mapping[str, LayerReader] = field(default_factory=dict)
    reads_layer_types: bool = True
    reads: frozenset[str] = frozenset()  # fields that change the cache and that ``read`` understands
    reads_per_layer_config: bool = False  # ``read`` applies the config's per_layer_config itself
    aliases: Mapping[str, str] = field(default_factory=dict)  # usual field name -> this family's spelling

    @property
    def ssm_dtype_fields(self) -> tuple[str, ...]:
        """Where this family's configs name their SSM states' dtype: the fields of
        :data:`SSM_DTYPE_FIELDS` it reads."""
        return tuple(name for name in SSM_DTYPE_FIELDS if name in self.reads)

    def layers(self, config: ConfigFields) -> list[ModelLayer]:
        layer_types = config.data.get("layer_types")
        if self.reads_layer_types and isinstance(layer_types, list):
            return _per_layer(config, self.from_layer_types(config, layer_types))
        if self.reads_per_layer_config:
            return self.read(config)
        return _per_layer(config, self.read(config))

    def from_layer_types(self, config: ConfigFields, layer_types: Sequence[Any]) -> list[ModelLayer]:
        """Layers from a ``layer_types`` list (gpt-oss, gemma, qwen3-next, ministral, ...)."""
        if len(layer_types) != config.integer("num_hidden_layers"):
            raise ModelConfigError(
                f"layer_types has {len(layer_types)} entries but num_hidden_layers is "
                f"{config.integer('num_hidden_layers')}"
            )
        readers = {**_ATTENTION_TYPES, **self.layer_types}
        layers: list[ModelLayer] = []
        for index, layer_type in enumerate(layer_types):
            reader = readers.get(layer_type)
            if reader is None:
                raise ModelConfigError(
                    f"layer {index}: layer_types entry {layer_type!r} is not supported for model_type "
                    f"{config.model_type!r}; expected one of {', '.join(readers)}"
                )
            layers.append(reader(config))
        return layers


# What a ``per_layer_config`` entry may override (transformers' heterogeneous configs, Gemma 4's full
# layers); anything else there that changes the cache is refused.
_PER_LAYER_FIELDS = {"head_dim": "head_size", "num_key_value_heads": "num_kv_heads"}


def per_layer_entries(config: ConfigFields, count: int,
                      reads: Collection[str]) -> list[tuple[int, Any, Mapping[str, Any]]]:
    """The config's ``per_layer_config`` entries as (layer index, key as written, fields); refused: an entry that
    names no layer below ``count``, or that sets a field changing the cache outside ``reads``."""
    overrides = config.data.get("per_layer_config")
    if not overrides:
        return []
    if not isinstance(overrides, Mapping):
        raise ModelConfigError(f"per_layer_config must map layer indices to fields, got {overrides!r}")
    entries = []
    for key, fields in overrides.items():
        index = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else -1
        if not 0 <= index < count or not isinstance(fields, Mapping):
            raise ModelConfigError(f"per_layer_config entry {key!r}: expected a layer index below {count} "
                                   f"mapped to fields, got {fields!r}")
        unread = sorted(name for name in fields if name not in reads and changes_the_cache(name))
        if unread:
            raise ModelConfigError(f"per_layer_config[{key!r}] sets {unread}, which change what layer {index} caches "
                                   f"and are not read; refusing to guess")
        entries.append((index, key, fields))
    return entries


def _per_layer(config: ConfigFields, layers: list[ModelLayer]) -> list[ModelLayer]:
    """``layers`` with the attention overrides of the config's ``per_layer_config`` (keyed by layer index)."""
    layers = list(layers)
    for index, key, fields in per_layer_entries(config, len(layers), _PER_LAYER_FIELDS):
        changes = {_PER_LAYER_FIELDS[name]: value for name, value in fields.items() if name in _PER_LAYER_FIELDS}
        layer = layers[index]
        if not changes or isinstance(layer, NoCacheLayer):  # a layer sharing another's KV keeps none of its own
            continue
        if not isinstance(layer, AttentionLayer) or not all(is_int_at_least(value, 1) for value in changes.values()):
            raise ModelConfigError(f"per_layer_config[{key!r}] sets {sorted(fields)} on layer {index}, which is "
                                   f"{layer.summary}; expected positive ints on an attention layer")
        layers[index] = dataclasses.replace(layer, **changes)
    return layers


FAMILIES: dict[str, Family] = {}


def family(
    *model_types: str, defaults: Mapping[str, Any] | None = None,
    layer_types: Mapping[str, LayerReader] | None = None, reads_layer_types: bool = True,
    reads: Iterable[str] = (), aliases: Mapping[str, str] | None = None, reads_per_layer_config: bool = False,
) -> Callable[[Reader], Reader]:
    def register(read: Reader) -> Reader:
        family = Family(read=read, defaults=defaults or {}, layer_types=layer_types or {},
                        reads_layer_types=reads_layer_types, reads=frozenset(reads), aliases=aliases or {},
                        reads_per_layer_config=reads_per_layer_config)
        for model_type in model_types:
            FAMILIES[model_type] = family
        return read

    return register


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def unread_cache_fields(data: Mapping[str, Any], family: Family) -> list[str]:
    """Fields of ``data`` that change the cache, are set, and that ``family`` does not read."""
    return sorted(
        name for name, value in data.items()
        if changes_the_cache(name) and _is_set(value) and name not in family.reads
    )


def from_layer_types(config: ConfigFields, layer_types: list[str]) -> list[ModelLayer]:
    """A family's own layer pattern, written as ``layer_types`` entries."""
    return config.family.from_layer_types(config, layer_types)
