"""The backend's settings, read from SGLang's ``--hicache-storage-backend-extra-config``.

``{"store": URL or [URLs], "salt": S, "secret_file": PATH, "encrypt": bool}``: where pages live (a list is
a tier chain, fastest first; ``memory://`` only for one process), the tenant salt that keeps this
deployment's keys apart from others', the file holding the deployment's secret (else
``$KVGROUPS_STORE_SECRET``, else none) and whether entries are encrypted. The keys SGLang itself reads
from the same JSON (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...) are left to
it; any other key is refused by name, so a misspelt option never goes unnoticed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvgroups.errors import KVGroupsError
from kvgroups.integrations.store_options import STORE_KEYS, StoreOptions, read_store_options
from kvgroups.store.backends.url_parts import mask_url

KNOWN_KEYS = STORE_KEYS
# What SGLang's own code reads from the extra config (the dynamic backend's loader, the data path switch,
# the file backend's directory); they reach the backend too and are not ours to refuse.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
               "enable_metadata_cache", "metadata_ttl")


class BackendConfigError(KVGroupsError):
    """The extra config is not what the backend takes; the message lists every problem."""


@dataclass(frozen=True)
class BackendSettings(StoreOptions):
    """The store options every integration reads, and SGLang's data path switch; ``stores`` may hold
    passwords: shown masked (repr, errors, logs)."""

    interface_v1: bool = False

    @property
    def shown_stores(self) -> list[str]:
        return [mask_url(url) for url in self.stores]

    def __repr__(self) -> str:
        return (f"BackendSettings(stores={self.shown_stores}, salt=<{len(self.salt)} chars>, "
                f"secret={'<set>' if self.secret else None}, encrypt={self.encrypt}, interface_v1={self.interface_v1})")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """The settings in ``extra`` (SGLang's ``HiCacheStorageConfig.extra_config``); raises
        :class:`BackendConfigError` naming every field that is wrong and what it takes."""
        if not isinstance(extra, Mapping):
            raise BackendConfigError("--hicache-storage-backend-extra-config for kvgroups needs at least "
                                     "{\"store\": URL}, got none")
        problems = []
        unknown = sorted(set(extra) - set(KNOWN_KEYS) - set(SGLANG_KEYS))
        if unknown:
            problems.append(f"unknown keys {unknown} (known: {', '.join(KNOWN_KEYS)})")
        options = read_store_options(extra, problems)
        if problems:
            raise BackendConfigError("--hicache-storage-backend-extra-config for kvgroups: " + "; ".join(problems))
        return cls(**{option.name: getattr(options, option.name) for option in fields(options)},
                   interface_v1=bool(extra.get("interface_v1", 0)))
