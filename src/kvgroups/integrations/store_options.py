"""The store options every engine integration reads from its extra config, read one way.

``store`` (a store URL, or a non-empty list of them: a tier chain, fastest first), ``salt`` (a tenant's
salt), ``secret_file`` (the deployment's secret, else ``$KVGROUPS_STORE_SECRET``, else none) and
``encrypt`` (needs a secret). Each integration adds its own options and its own message; the problems
found here are appended to its list, so one error names every field that is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.url_parts import mask_url
from kvgroups.store.entries.secret import ENVIRONMENT_VARIABLE, StoreSecret

STORE_KEYS = ("store", "salt", "secret_file", "encrypt")


@dataclass(frozen=True)
class StoreOptions:
    """``stores`` may hold passwords and ``salt`` is a tenant's: neither is shown (repr, errors, logs)."""

    stores: tuple[str, ...] = field(repr=False)
    salt: str = field(default="", repr=False)
    secret: StoreSecret | None = field(default=None, compare=False)
    encrypt: bool = False


def read_store_options(extra: Mapping[str, Any], problems: list[str]) -> StoreOptions:
    """The store options in ``extra``; each one that is wrong adds a line to ``problems`` (and a default here)."""
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
        salt = ""
    encrypt = extra.get("encrypt", False)
    if not isinstance(encrypt, bool):
        problems.append(f"'encrypt' must be a bool, got {encrypt!r}")
        encrypt = False
    secret = None
    secret_file = extra.get("secret_file")
    try:
        secret = StoreSecret.from_file(secret_file) if secret_file is not None else StoreSecret.resolve(None)
    except (KVGroupsError, TypeError) as error:
        problems.append(f"'secret_file': {error}")
    if encrypt is True and secret is None:
        problems.append(f"'encrypt' needs a secret ('secret_file', or ${ENVIRONMENT_VARIABLE})")
    return StoreOptions(stores=tuple(urls), salt=salt, secret=secret, encrypt=encrypt)
