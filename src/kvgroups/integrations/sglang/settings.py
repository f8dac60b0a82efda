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
from dataclasses import dataclass, field
from typing import Any

from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.url_parts import mask_url
from kvgroups.store.entries.secret import ENVIRONMENT_VARIABLE, StoreSecret

KNOWN_KEYS = ("store", "salt", "secret_file", "encrypt")
# What SGLang's own code reads from the extra config (the dynamic backend's loader, the data path switch,
# the file backend's directory); they reach the backend too and are not ours to refuse.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
               "enable_metadata_cache", "metadata_ttl")


class BackendConfigError(KVGroupsError):
    """The extra config is not what the backend takes; the message lists every problem."""


@dataclass(frozen=True)
class BackendSettings:
    """``stores`` may hold passwords: shown masked (repr, errors, logs)."""

    stores: tuple[str, ...] = field(repr=False)
    salt: str = ""
    secret: StoreSecret | None = field(default=None, compare=False)
    encrypt: bool = False
    interface_v1: bool = False

    @property
    def shown_stores(self) -> list[str]:
        return [mask_url(url) for url in self.stores]

    def __repr__(self) -> str:
        return (f"BackendSettings(stores={self.shown_stores}, salt={self.salt!r}, secret={self.secret!r}, "
                f"encrypt={self.encrypt}, interface_v1={self.interface_v1})")

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
        store = extra.get("store")
        urls = [store] if isinstance(store, str) else store
        if not isinstance(urls, (list, tuple)) or not urls or not all(isinstance(url, str) and url for url in urls):
            shown = [mask_url(url) if isinstance(url, str) else url for url in urls] \
                if isinstance(urls, (list, tuple)) else store
            problems.append(f"'store' must be a store URL or a non-empty list of them, got {shown!r}")
            urls = []
        salt = extra.get("salt", "")
        if not isinstance(salt, str):
            problems.append(f"'salt' must be a str, got {type(salt).__name__}")
        encrypt = extra.get("encrypt", False)
        if not isinstance(encrypt, bool):
            problems.append(f"'encrypt' must be a bool, got {encrypt!r}")
        secret = None
        secret_file = extra.get("secret_file")
        try:
            secret = StoreSecret.from_file(secret_file) if secret_file is not None else StoreSecret.resolve(None)
        except (KVGroupsError, TypeError) as error:
            problems.append(f"'secret_file': {error}")
        if encrypt is True and secret is None:
            problems.append(f"'encrypt' needs a secret ('secret_file', or ${ENVIRONMENT_VARIABLE})")
        if problems:
            raise BackendConfigError("--hicache-storage-backend-extra-config for kvgroups: " + "; ".join(problems))
        return cls(stores=tuple(urls), salt=salt, secret=secret, encrypt=encrypt,
                   interface_v1=bool(extra.get("interface_v1", 0)))
