"""``open_store(url)``: a byte store from a URL, or a tiered store from a list of them.

- ``memory://?max_bytes=1GiB``: :class:`~kvgroups.store.backends.memory.MemoryStore` (default budget 1GiB);
- ``file:///dir?max_bytes=16GiB``: :class:`~kvgroups.store.backends.files.store.FileStore` (default budget 16GiB,
  or less where the filesystem is smaller);
- ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path.sock?db=0``:
  :class:`~kvgroups.store.backends.redis.store.RedisStore`, options in :mod:`kvgroups.store.backends.redis.settings`;
- ``redis-cluster://host:port[,host:port...]/``, ``rediss-cluster://...``: a Valkey/Redis Cluster,
  :class:`~kvgroups.store.backends.redis.cluster.RedisClusterStore`;
- ``mooncake://master:port?metadata=...&segment=1GiB``: a Mooncake Store pool,
  :class:`~kvgroups.store.backends.mooncake.store.MooncakeStore`, options in
  :mod:`kvgroups.store.backends.mooncake.settings`.

Sizes take a unit (``512MiB``, ``8GiB``). A bad URL or option is an error naming it; a password
in a URL is never shown (``***``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from kvgroups.core.sizes import parse_size
from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.base import ByteStore
from kvgroups.store.backends.files.store import FileStore
from kvgroups.store.backends.memory import DEFAULT_MAX_BYTES as MEMORY_MAX_BYTES
from kvgroups.store.backends.memory import MemoryStore
from kvgroups.store.backends.mooncake.settings import parse_mooncake_url
from kvgroups.store.backends.redis.settings import parse_redis_url
from kvgroups.store.backends.tiered import TieredStore
from kvgroups.store.backends.url_parts import mask_url, url_options

StoreArg = str | Sequence[str] | ByteStore
Opener = Callable[[str, str, str, bool], ByteStore]


def _memory(url: str, path: str, query: str, create: bool) -> ByteStore:
    if path not in ("", "/"):
        raise KVGroupsError(f"store URL {url!r}: memory:// takes no path, got {path!r}")
    options = url_options(url, query, ["max_bytes"])
    max_bytes = parse_size(options["max_bytes"], "max_bytes") if "max_bytes" in options else MEMORY_MAX_BYTES
    return MemoryStore(max_bytes)


def _file(url: str, path: str, query: str, create: bool) -> ByteStore:
    if not path or not path.startswith("/"):
        raise KVGroupsError(f"store URL {url!r}: file:// needs an absolute directory, e.g. file:///var/cache/kv")
    options = url_options(url, query, ["max_bytes"])
    max_bytes = parse_size(options["max_bytes"], "max_bytes") if "max_bytes" in options else None
    return FileStore(path, max_bytes, create=create)


def _redis(url: str, path: str, query: str, create: bool) -> ByteStore:
    from kvgroups.store.backends.redis.store import RedisStore  # noqa: PLC0415 - loads the optional redis client

    return RedisStore(parse_redis_url(url))


def _redis_cluster(url: str, path: str, query: str, create: bool) -> ByteStore:
    from kvgroups.store.backends.redis.cluster import RedisClusterStore  # noqa: PLC0415 - loads the optional redis client

    return RedisClusterStore(parse_redis_url(url))


def _mooncake(url: str, path: str, query: str, create: bool) -> ByteStore:
    settings = parse_mooncake_url(url)  # checked before the optional client loads
    from kvgroups.store.backends.mooncake.store import MooncakeStore  # noqa: PLC0415 - loads the optional client

    return MooncakeStore(settings)


_OPENERS: Mapping[str, Opener] = {
    "memory": _memory, "file": _file, "redis": _redis, "rediss": _redis, "unix": _redis,
    "redis-cluster": _redis_cluster, "rediss-cluster": _redis_cluster, "mooncake": _mooncake,
}


def open_store(url: StoreArg, *, create: bool = True) -> ByteStore:
    """The byte store a URL names.

    Args:
        url: ``memory://``, ``file:///dir``, ``redis://host:port/db``, ``rediss://...``,
            ``unix:///path.sock``, ``mooncake://master:port`` (options after ``?``, see the module
            docstring); a list of them is a tiered store, fastest first (a list of one is that
            store); a :class:`ByteStore` is returned as it is.
        create: False opens only stores that exist (a ``file://`` directory is not created).

    Returns:
        The store, open; close it (or use it as a context manager) when done.

    Raises:
        KVGroupsError: an unknown scheme, option or value, naming it (never a password).
        TypeError: ``url`` is neither a str, a list of str nor a store.
        StoreError: the store cannot be opened (no such store, no redis client).
    """
    if isinstance(url, ByteStore):
        return url
    if isinstance(url, (list, tuple)):
        if not url:
            raise KVGroupsError("a list of store URLs must not be empty")
        if len(url) == 1:
            return open_store(url[0], create=create)
        return TieredStore([open_store(item, create=create) for item in url])
    if not isinstance(url, str):
        raise TypeError(f"a store is a URL, a list of URLs or a store, got {type(url).__name__}")
    parts = urlsplit(url)
    opener = _OPENERS.get(parts.scheme)
    if opener is None:
        raise KVGroupsError(f"store URL {mask_url(url)!r}: unknown scheme {parts.scheme!r}; expected one of "
                            f"{', '.join(scheme + '://' for scheme in _OPENERS)}")
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        raise KVGroupsError(f"store URL {url!r}: file:// takes a local path (file:///dir), not host {parts.netloc!r}")
    return opener(url, parts.path, parts.query, create)
