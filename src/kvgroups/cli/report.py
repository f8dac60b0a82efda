"""``kvgroups inspect`` without the printing: the report of one rank, assembled as plain data.

The numbers come from the objects :func:`~kvgroups.models.engine.build_rank` builds (the same
groups and ``LMCacheMetadata`` a serving engine's connector would build, on meta tensors) and
from :mod:`kvgroups.models.capacity`; this module only assembles them (``Report.to_dict`` is the
JSON of ``--json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvgroups.core.cache_specs import spec_from_dict
from kvgroups.core.dtypes import dtype_name
from kvgroups.core.formatting import compact_ranges
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.core.sizes import per_token
from kvgroups.models.capacity import Fit, GroupCost, memory_needed, tokens_that_fit
from kvgroups.models.engine import CrossAttention, EngineParams, RankBuild, build_rank
from kvgroups.models.layers import ModelSpec

REPORT_FORMAT = "kvgroups.inspect/1"


@dataclass(frozen=True, kw_only=True)
class GroupReport:
    """One group's row of the report (all sizes per rank)."""

    group: KVLayerGroupInfo
    model_layers: tuple[int, ...]
    holds: str
    values_padded_from: int | None  # the values' own head size, where the layout pads them to the keys'
    chunk_shape: torch.Size
    bytes_per_token: float  # an int but where one slot serves several tokens (compressed rows)
    bytes_per_sequence: int
    chunk_bytes: int
    block_tokens: int | None  # tokens a block of the engine's own pages covers (None: --block-size)
    page_bytes: int | None  # one layer's page in the engine's own pages, padded as it pads them

    def to_dict(self, index: int) -> dict[str, Any]:
        group = self.group
        return {
            "index": index,
            "layers": compact_ranges(self.model_layers),
            "model_layers": list(self.model_layers),
            "layer_indices": list(group.layer_indices),
            "num_layers": group.num_layers,
            "kind": group.kind.value,
            "holds": self.holds,
            "spec": group.spec.to_dict(),
            "layout": group.layout.value,
            "tensor_shape": list(group.shape),
            "tensors_per_layer": group.key.tensors_per_layer,
            "dtype": dtype_name(group.dtype),
            "num_kv_heads": group.num_heads,
            "head_size": group.head_size,
            "value_head_size": group.value_head_size or group.head_size,
            "values_padded_from": self.values_padded_from,
            "hidden_dim_size": group.hidden_dim_size,
            "value_hidden_dim_size": group.value_hidden_dim_size,
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_sequence": self.bytes_per_sequence,
            "block_tokens": self.block_tokens,
            "page_bytes": self.page_bytes,
            "chunk_shape": list(self.chunk_shape),
            "chunk_bytes": self.chunk_bytes,
        }


def costs_of(groups: list[dict[str, Any]], cross_attention: dict[str, Any] | None) -> list[GroupCost]:
    """What each group (as the JSON report lists it), then the images of cross-attention layers,
    cost per token and per sequence: what capacities and the plot are computed from."""
    costs = [GroupCost(spec=spec_from_dict(group["spec"]), bytes_per_token=group["bytes_per_token"],
                       bytes_per_sequence=group["bytes_per_sequence"], block_tokens=group.get("block_tokens"))
             for group in groups]
    if cross_attention is not None and cross_attention["bytes_per_sequence"]:
        costs.append(GroupCost(spec=None, bytes_per_token=0, bytes_per_sequence=cross_attention["bytes_per_sequence"]))
    return costs


def _cross_attention_dict(cross: CrossAttention | None) -> dict[str, Any] | None:
    if cross is None:
        return None
    return {
        "layers": compact_ranges(cross.model_layers),
        "model_layers": list(cross.model_layers),
        "num_layers": len(cross.model_layers),
        "num_kv_heads": cross.num_kv_heads,
        "head_size": cross.head_size,
        "dtype": dtype_name(cross.dtype),
        "tokens_per_image": cross.tokens_per_image,
        "bytes_per_image": cross.bytes_per_image,
        "images": cross.images,
        "bytes_per_sequence": cross.bytes_per_sequence,
    }


@dataclass(frozen=True, kw_only=True)
class Report:
    model_name: str
    source: str
    model: ModelSpec
    params: EngineParams
    build: RankBuild
    groups: tuple[GroupReport, ...]
    warnings: tuple[str, ...]

    @property
    def metadata(self) -> LMCacheMetadata:
        return self.build.metadata

    @property
    def bytes_per_token_per_rank(self) -> float:
        return exact(sum(row.bytes_per_token for row in self.groups))

    @property
    def state_bytes_per_sequence_per_rank(self) -> int:
        return sum(row.bytes_per_sequence for row in self.groups)

    @property
    def bytes_per_chunk_per_rank(self) -> int:
        return sum(row.chunk_bytes for row in self.groups)

    def costs(self) -> list[GroupCost]:
        return costs_of([row.to_dict(index) for index, row in enumerate(self.groups)],
                        _cross_attention_dict(self.build.cross_attention))

    def memory_for_tokens(self, *, hybrid: bool) -> int | None:
        if self.params.tokens is None:
            return None
        return memory_needed(self.costs(), self.params.tokens, self.params.seqs, self.params.block_size,
                             hybrid=hybrid)

    def fit_in_memory(self, *, hybrid: bool) -> Fit | None:
        if self.params.memory_gib is None:
            return None
        return tokens_that_fit(
            self.costs(), int(self.params.memory_bytes or 0), self.params.seqs, self.params.block_size,
            self.model.max_position_embeddings, hybrid=hybrid,
        )

    def _capacity(self) -> dict[str, Any]:
        params, tp = self.params, self.params.tp
        capacity: dict[str, Any] = {"memory": None, "tokens": None}
        hybrid_fit, full_fit = self.fit_in_memory(hybrid=True), self.fit_in_memory(hybrid=False)
        if hybrid_fit is not None and full_fit is not None:
            capacity["memory"] = {
                "budget_bytes_per_rank": params.memory_bytes or 0,
                "sequences": params.seqs,
                "tokens_per_sequence": hybrid_fit.tokens_per_sequence,
                "total_tokens": _times(hybrid_fit.tokens_per_sequence, params.seqs),
                "limited_by": hybrid_fit.limited_by,
                "tokens_per_sequence_all_full": full_fit.tokens_per_sequence,
                "total_tokens_all_full": _times(full_fit.tokens_per_sequence, params.seqs),
                "limited_by_all_full": full_fit.limited_by,
            }
        hybrid_need, full_need = self.memory_for_tokens(hybrid=True), self.memory_for_tokens(hybrid=False)
        if hybrid_need is not None and full_need is not None:
            capacity["tokens"] = {
                "tokens_per_sequence": params.tokens,
                "sequences": params.seqs,
                "bytes_per_rank": hybrid_need,
                "bytes_all_ranks": hybrid_need * tp,
                "bytes_per_rank_all_full": full_need,
                "bytes_all_ranks_all_full": full_need * tp,
            }
        return capacity

    def to_dict(self) -> dict[str, Any]:
        params, tp, dtypes = self.params, self.params.tp, self.build.dtypes
        return {
            "format": REPORT_FORMAT,
            "model": self.model_name,
            "source": self.source,
            "model_type": self.model.model_type,
            "max_position_embeddings": self.model.max_position_embeddings,
            "engine": {
                "tp": tp, "rank": params.rank, "block_size": params.block_size, "layout": self.build.layout.value,
                "kv_dtype": dtype_name(dtypes.kv), "state_dtype": _name_or_none(dtypes.state),
                "conv_state_dtype": _name_or_none(dtypes.conv_state),
                "ssm_state_dtype": _name_or_none(dtypes.ssm_state),
                "chunk_size": params.chunk_size, "num_blocks": self.build.num_blocks, "memory_gib": params.memory_gib,
                "tokens": params.tokens, "seqs": params.seqs, "images": params.images,
            },
            "layers": {"total": len(self.model.layers), "with_cache": self.build.layers_with_cache},
            "groups": [row.to_dict(index) for index, row in enumerate(self.groups)],
            "cross_attention": _cross_attention_dict(self.build.cross_attention),
            "totals": {
                "bytes_per_token_per_rank": self.bytes_per_token_per_rank,
                "bytes_per_token_all_ranks": self.bytes_per_token_per_rank * tp,
                "state_bytes_per_sequence_per_rank": self.state_bytes_per_sequence_per_rank,
                "state_bytes_per_sequence_all_ranks": self.state_bytes_per_sequence_per_rank * tp,
                "bytes_per_chunk_per_rank": self.bytes_per_chunk_per_rank,
                "fingerprint": self.metadata.fingerprint(),
            },
            "capacity": self._capacity(),
            "warnings": list(self.warnings),
            "metadata": self.metadata.to_dict(),
        }


def _times(tokens: int | None, sequences: int) -> int | None:
    return None if tokens is None else tokens * sequences


def exact(value: float) -> float:
    """``value`` as an int where it is whole (JSON keeps ints as before), else as the float it is (a page over
    a power-of-two block: exact in binary)."""
    return int(value) if float(value).is_integer() else value


def _page_costs(build: RankBuild, group: KVLayerGroupInfo) -> tuple[float, int | None, int | None]:
    """Bytes per token of a group in the engine's own pages (each layer's padded page over its block), that
    block's tokens and one layer's page; the group's own bytes per token where the engine fixes no page."""
    pages = [build.pages_of.get(name) for name in group.layer_names]
    if any(page is None for page in pages):
        return group.bytes_per_token, None, None
    kinds = {(page.block_tokens, page.page_bytes) for page in pages if page is not None}
    (block_tokens, page_bytes), = kinds  # equal specs and shapes group together: one page per group
    return per_token(page_bytes * group.num_layers, block_tokens), block_tokens, page_bytes


def _group_rows(build: RankBuild) -> tuple[GroupReport, ...]:
    metadata = build.metadata
    groups = metadata.kv_layer_groups_manager.kv_layer_groups
    costs = [_page_costs(build, group) for group in groups]
    return tuple(
        GroupReport(
            group=group,
            model_layers=tuple(build.model_layer_of[name] for name in group.layer_names),
            holds=", ".join(dict.fromkeys(build.holds_of[name] for name in group.layer_names)),
            values_padded_from=next((build.padded_values_of[name] for name in group.layer_names
                                     if name in build.padded_values_of), None),
            chunk_shape=chunk_shape,
            bytes_per_token=per_token,
            bytes_per_sequence=group.bytes_per_sequence,
            chunk_bytes=group.chunk_bytes(metadata.chunk_size),
            block_tokens=block_tokens,
            page_bytes=page_bytes,
        )
        for group, chunk_shape, (per_token, block_tokens, page_bytes)
        in zip(groups, metadata.get_shapes(), costs, strict=True)
    )


def _engine_warnings(spec: ModelSpec, params: EngineParams, build: RankBuild) -> list[str]:
    warnings = []
    limit = spec.max_position_embeddings
    if params.tokens is not None and limit is not None and params.tokens > limit:
        warnings.append(f"--tokens {params.tokens} is beyond the model's context (max_position_embeddings {limit})")
    if build.cross_attention is None and (params.images or params.image_tokens is not None):
        warnings.append("--images / --image-tokens ignored: the model has no cross-attention layers")
    padded = sorted({(build.padded_values_of[name], build.model_layer_of[name]) for name in build.padded_values_of})
    if padded:
        sizes = sorted({size for size, _ in padded})
        warnings.append(
            f"layout {build.layout.value} holds keys and values in one head size: the values of layers "
            f"{compact_ranges([layer for _, layer in padded])} ({'/'.join(map(str, sizes))} dims) are counted padded "
            f"to the keys' size; vLLM stores them unpadded (--layout vllm, the default for this model)"
        )
    return warnings


def inspect_model(spec: ModelSpec, model_name: str, params: EngineParams, source: str = "") -> Report:
    """Build the caches of ``spec`` on the meta device for one rank and describe them."""
    build = build_rank(spec, model_name, params)
    return Report(
        model_name=model_name, source=source, model=spec, params=params, build=build, groups=_group_rows(build),
        warnings=(*spec.warnings, *_engine_warnings(spec, params, build)),
    )


def _name_or_none(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else dtype_name(dtype)
