"""``LMCacheMetadata``: who stores chunks (model, ranks) and the chunk format of each group."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvgroups.core.checks import int_at_least, is_int_at_least
from kvgroups.core.dtypes import dtype_from_name, dtype_name
from kvgroups.core.groups import KVLayerGroupInfo
from kvgroups.core.layouts import KVLayout
from kvgroups.core.manager import KVLayerGroupsManager
from kvgroups.errors import KVGroupsError

METADATA_FORMAT = "kvgroups.metadata/1"
# Bump when the fingerprint's inputs change meaning, so old stores are never misread.
CHUNK_FORMAT = "kvgroups.chunk/1"


@dataclass
class LMCacheMetadata:
    """Serving-engine facts a KV store needs, LMCache-compatible.

    ``kv_shape`` is ``(num_layer, kv_size, chunk_size, num_kv_head, head_size)`` with kv_size
    1 for MLA and 2 otherwise; once groups are built, the groups are the authority on shapes.
    """

    model_name: str
    world_size: int
    local_world_size: int
    worker_id: int
    local_worker_id: int
    kv_dtype: torch.dtype
    kv_shape: tuple[int, int, int, int, int]
    use_mla: bool = False
    role: str | None = None
    first_rank = 0  # a class attribute, not a field, as in LMCache
    served_model_name: str | None = None
    chunk_size: int = 256
    kv_layer_groups_manager: KVLayerGroupsManager = field(default_factory=KVLayerGroupsManager)
    engine_id: str | None = None
    kv_connector_extra_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not isinstance(self.model_name, str):
            problems.append(f"model_name must be a str, got {self.model_name!r}")
        if not is_int_at_least(self.world_size, 1):
            problems.append(f"world_size must be an int >= 1, got {self.world_size!r}")
        elif not is_int_at_least(self.worker_id, 0) or self.worker_id >= self.world_size:
            problems.append(
                f"worker_id must be an int in [0, world_size={self.world_size}), got {self.worker_id!r}"
            )
        if not is_int_at_least(self.local_world_size, 1):
            problems.append(f"local_world_size must be an int >= 1, got {self.local_world_size!r}")
        elif not is_int_at_least(self.local_worker_id, 0) or self.local_worker_id >= self.local_world_size:
            problems.append(
                f"local_worker_id must be an int in [0, local_world_size={self.local_world_size}), "
                f"got {self.local_worker_id!r}"
            )
        if not is_int_at_least(self.chunk_size, 1):
            problems.append(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if not isinstance(self.kv_dtype, torch.dtype):
            problems.append(f"kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")
        if not isinstance(self.use_mla, bool):
            problems.append(f"use_mla must be a bool, got {self.use_mla!r}")
        shape = self.kv_shape
        if (
            not isinstance(shape, (tuple, list, torch.Size))
            or len(shape) != 5
            or not all(is_int_at_least(dim, 1) for dim in shape)
        ):
            problems.append(
                f"kv_shape must be 5 positive ints (num_layer, kv_size, chunk_size, num_kv_head, "
                f"head_size), got {shape!r}"
            )
        elif shape[1] != (1 if self.use_mla else 2):
            problems.append(
                f"kv_shape[1] (kv_size) is {shape[1]} but use_mla={self.use_mla} needs "
                f"{1 if self.use_mla else 2}"
            )
        if not isinstance(self.kv_layer_groups_manager, KVLayerGroupsManager):
            problems.append(
                f"kv_layer_groups_manager must be a KVLayerGroupsManager, "
                f"got {type(self.kv_layer_groups_manager).__name__}"
            )
        if self.kv_connector_extra_config is not None and not isinstance(
            self.kv_connector_extra_config, dict
        ):
            problems.append(
                f"kv_connector_extra_config must be a dict or None, "
                f"got {type(self.kv_connector_extra_config).__name__}"
            )
        if problems:
            raise KVGroupsError("bad LMCacheMetadata: " + "; ".join(problems))
        self.kv_shape = tuple(self.kv_shape)  # type: ignore[assignment]
        # use_mla must agree with the groups: now, and whenever groups are built or replaced.
        self.kv_layer_groups_manager.add_check(self._check_use_mla)

    @classmethod
    def for_groups(
        cls, groups: Sequence[KVLayerGroupInfo], *, model_name: str, chunk_size: int, world_size: int = 1,
        worker_id: int = 0, kv_dtype: torch.dtype | None = None, role: str | None = None,
        engine_id: str | None = None,
    ) -> LMCacheMetadata:
        """The metadata of one rank whose layers are ``groups`` (built already, in layer order).

        The legacy single-shape fields are derived from the groups: ``use_mla`` when any group
        holds MLA latents, ``kv_shape`` from the first group (one head of its state for a
        recurrent group), ``kv_dtype`` from the first token-indexed group unless given (an
        engine asked for a KV dtype names it even for a model of states only).
        """
        groups = list(groups)
        if not groups:
            raise KVGroupsError("LMCacheMetadata.for_groups needs at least one group")
        use_mla = any(group.layout is KVLayout.MLA for group in groups)
        token_groups = [group for group in groups if group.token_indexed]
        first = groups[0]
        kv_shape = (sum(group.num_layers for group in groups), 1 if use_mla else 2, chunk_size,
                    1 if use_mla else first.num_heads, first.head_size)
        manager = KVLayerGroupsManager()
        metadata = cls(
            model_name=model_name, world_size=world_size, local_world_size=world_size, worker_id=worker_id,
            local_worker_id=worker_id, kv_dtype=kv_dtype or (token_groups or groups)[0].dtype, kv_shape=kv_shape,
            use_mla=use_mla, role=role, chunk_size=chunk_size, kv_layer_groups_manager=manager, engine_id=engine_id,
        )
        manager.kv_layer_groups = groups
        return metadata

    def is_first_rank(self) -> bool:
        return self.worker_id == self.first_rank

    def _check_use_mla(self, groups: Sequence[KVLayerGroupInfo]) -> None:
        if not groups:
            return
        mla = [index for index, group in enumerate(groups) if group.layout is KVLayout.MLA]
        paged_kv = [index for index, group in enumerate(groups) if group.kv_size == 2]
        if self.use_mla and not mla:
            raise KVGroupsError(
                f"use_mla=True but no group holds an MLA cache (groups {paged_kv} hold K and V); "
                f"set use_mla=False"
            )
        if not self.use_mla and mla:
            raise KVGroupsError(
                f"use_mla=False but groups {mla} hold MLA caches; set use_mla=True"
            )

    def get_dtypes(self) -> list[torch.dtype]:
        """One dtype per group; ``[kv_dtype]`` before groups are built."""
        groups = self.kv_layer_groups_manager.kv_layer_groups
        if groups:
            return [group.dtype for group in groups]
        return [self.kv_dtype]

    def get_shapes(self, num_tokens: int | None = None) -> list[torch.Size]:
        """One chunk shape per group: ``[kv_size, num_layers, num_tokens, hidden_dim_size]``.

        kv_size comes from each group's layout (2 for K/V, 1 for MLA), so models mixing MLA and
        K/V groups get right shapes. Recurrent groups store one state per sequence:
        ``[1, num_layers, 1, state_elements]``. ``num_tokens`` defaults to ``chunk_size``.
        """
        if num_tokens is None:
            num_tokens = self.chunk_size
        int_at_least("num_tokens", num_tokens, 0)
        groups = self.kv_layer_groups_manager.kv_layer_groups
        if groups:
            return [group.chunk_shape(num_tokens) for group in groups]
        shape = self.kv_shape
        return [torch.Size([shape[1], shape[0], num_tokens, shape[3] * shape[4]])]

    def get_num_groups(self) -> int:
        groups = self.kv_layer_groups_manager.kv_layer_groups
        return len(groups) if groups else 1

    # --- identity of the stored format ---------------------------------------------------
    def chunk_format(self) -> dict[str, Any]:
        """Everything that decides how a stored chunk's bytes are read, as plain data."""
        groups = self.kv_layer_groups_manager.kv_layer_groups
        described: dict[str, Any] = {
            "format": CHUNK_FORMAT,
            "model_name": self.model_name,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "chunk_size": self.chunk_size,
        }
        if groups:
            described["groups"] = [self._group_format(group) for group in groups]
        else:
            described["kv_shape"] = list(self.kv_shape)
            described["kv_dtype"] = dtype_name(self.kv_dtype)
            described["use_mla"] = self.use_mla
        return described

    def _group_format(self, group: KVLayerGroupInfo) -> dict[str, Any]:
        described = {
            "layer_indices": list(group.layer_indices),
            "chunk_shape": list(group.chunk_shape(self.chunk_size)),
            "num_heads": group.num_heads,
            "head_size": group.head_size,
            "dtype": dtype_name(group.dtype),
            "layout": group.layout.value,
            "spec": group.spec.to_dict(),
        }
        if group.value_head_size is not None:  # only where it differs: every other fingerprint unchanged
            described["value_head_size"] = group.value_head_size
        return described

    def fingerprint(self) -> str:
        """SHA-256 hex digest of :meth:`chunk_format`: equal exactly when chunks read the same.

        num_blocks, engine_id, role and the connector's extra config do not enter it.
        """
        canonical = json.dumps(self.chunk_format(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    # --- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": METADATA_FORMAT,
            "model_name": self.model_name,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "worker_id": self.worker_id,
            "local_worker_id": self.local_worker_id,
            "kv_dtype": dtype_name(self.kv_dtype),
            "kv_shape": list(self.kv_shape),
            "use_mla": self.use_mla,
            "role": self.role,
            "served_model_name": self.served_model_name,
            "chunk_size": self.chunk_size,
            "kv_layer_groups_manager": self.kv_layer_groups_manager.to_dict(),
            "engine_id": self.engine_id,
            "kv_connector_extra_config": copy.deepcopy(self.kv_connector_extra_config),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LMCacheMetadata:
        if not isinstance(data, Mapping) or data.get("format") != METADATA_FORMAT:
            raise KVGroupsError(f"not a serialized LMCacheMetadata: expected format {METADATA_FORMAT!r}")
        required = ("model_name", "world_size", "local_world_size", "worker_id",
                    "local_worker_id", "kv_dtype", "kv_shape")
        missing = [name for name in required if name not in data]
        if missing:
            raise KVGroupsError(f"serialized LMCacheMetadata lacks fields {missing}")
        manager_data = data.get("kv_layer_groups_manager")
        return cls(
            model_name=data["model_name"],
            world_size=data["world_size"],
            local_world_size=data["local_world_size"],
            worker_id=data["worker_id"],
            local_worker_id=data["local_worker_id"],
            kv_dtype=dtype_from_name(data["kv_dtype"]),
            kv_shape=tuple(data["kv_shape"]),
            use_mla=data.get("use_mla", False),
            role=data.get("role"),
            served_model_name=data.get("served_model_name"),
            chunk_size=data.get("chunk_size", 256),
            kv_layer_groups_manager=(
                KVLayerGroupsManager.from_dict(manager_data)
                if manager_data is not None else KVLayerGroupsManager()
            ),
            engine_id=data.get("engine_id"),
            kv_connector_extra_config=copy.deepcopy(data.get("kv_connector_extra_config")),
        )

    def to_json(self) -> str:
        try:
            return json.dumps(self.to_dict(), sort_keys=True)
        except TypeError as error:
            raise TypeError(
                f"LMCacheMetadata.kv_connector_extra_config is not JSON-serializable: {error}"
            ) from None

    @classmethod
    def from_json(cls, text: str) -> LMCacheMetadata:
        return cls.from_dict(json.loads(text))
