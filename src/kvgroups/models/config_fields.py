"""Reading a model family's config: field access with the family's defaults, and the family registry.

Fields and defaults follow the ``transformers`` config classes (the authority on defaults), read
without importing them. Each family registers one :class:`Family` by ``model_type``
(:func:`family`): its reader, its defaults, and how it reads a config's ``layer_types`` list
(which entries it knows beyond the attention kinds, or that its reader interprets the list
itself). Adding a family touches only its own registration, in :mod:`kvgroups.models.families`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgroups.errors import ModelConfigError
from kvgroups.kinds import ChunkedLocal, FullAttention, LayerCacheSpec, SlidingWindow
from kvgroups.models.layers import AttentionLayer, ModelLayer

GENERIC_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size")


class ConfigFields:
    """Field access with the family's defaults and errors that name the missing field."""

    def __init__(self, data: Mapping[str, Any], model_type: str, family: Family) -> None:
        self.data = data
        self.model_type = model_type
        self.family = family
        self.defaults = family.defaults

    def get(self, name: str, fallback: Any = None) -> Any:
        value = self.data.get(name)
        if value is None:
            value = self.defaults.get(name, fallback)
        return value

    def integer(self, name: str, *, minimum: int = 1) -> int:
        value = self.get(name)
        if value is None:
            raise ModelConfigError(f"config (model_type {self.model_type!r}) lacks field {name!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
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

    def sliding_window(self) -> int | None:
        """The window when set, not disabled and smaller than the longest context."""
        window = self.get("sliding_window")
        if window is None or self.get("use_sliding_window") is False:
            return None
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ModelConfigError(f"sliding_window must be a positive int or null, got {window!r}")
        max_positions = self.get("max_position_embeddings")
        if isinstance(max_positions, int) and window >= max_positions:
            return None  # the window covers every position the model can see
        return window

    def attention(self, spec: LayerCacheSpec, *head_size_fields: str) -> AttentionLayer:
        return AttentionLayer(spec=spec, num_kv_heads=self.num_kv_heads(), head_size=self.head_size(*head_size_fields))


Reader = Callable[[ConfigFields], list[ModelLayer]]
LayerReader = Callable[[ConfigFields], ModelLayer]


def _sliding(config: ConfigFields) -> ModelLayer:
    window = config.sliding_window()
    return config.attention(SlidingWindow(window_tokens=window) if window else FullAttention())


# The ``layer_types`` entries every family that uses the list shares.
_ATTENTION_TYPES: dict[str, LayerReader] = {
    "full_attention": lambda config: config.attention(FullAttention()),
    "sliding_attention": _sliding,
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

    def layers(self, config: ConfigFields) -> list[ModelLayer]:
        layer_types = config.data.get("layer_types")
        if self.reads_layer_types and isinstance(layer_types, list):
            return self.from_layer_types(config, layer_types)
        return self.read(config)

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


FAMILIES: dict[str, Family] = {}


def family(
    *model_types: str, defaults: Mapping[str, Any] | None = None,
    layer_types: Mapping[str, LayerReader] | None = None, reads_layer_types: bool = True,
) -> Callable[[Reader], Reader]:
    def register(read: Reader) -> Reader:
        family = Family(read=read, defaults=defaults or {}, layer_types=layer_types or {},
                        reads_layer_types=reads_layer_types)
        for model_type in model_types:
            FAMILIES[model_type] = family
        return read

    return register


def supported_model_types() -> list[str]:
    return sorted(FAMILIES)


def from_layer_types(config: ConfigFields, layer_types: list[str]) -> list[ModelLayer]:
    """A family's own layer pattern, written as ``layer_types`` entries."""
    return config.family.from_layer_types(config, layer_types)
