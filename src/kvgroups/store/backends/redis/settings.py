"""A Valkey/Redis store's settings, read from its URL once, checked, and shown without the password.

``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS), ``unix://[user:password@]/path.sock``
and, for a cluster, ``redis-cluster://[user:password@]host:port[,host:port...]/`` and
``rediss-cluster://...`` (any of its nodes: the others are discovered) take ``?ttl=`` (whole
seconds, at least 1), ``timeout=`` (seconds, finite and positive; 2 by default),
``max_connections=`` (a connection pool's size, 64 by default: threads beyond it wait for a
connection, up to the timeout), ``wait_replicas=`` (a write counts as saved only once this many
replicas acknowledged it, Redis' ``WAIT``; 0, the default, does not wait) and ``wait_timeout=``
(seconds ``WAIT`` waits, less than ``timeout``; half of it by default), ``db=`` (unix sockets) and,
with TLS, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile`` and ``ssl_cert_reqs`` (``required``,
``optional`` or ``none``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.url_parts import mask_url, url_options

DEFAULT_TIMEOUT_SECONDS = 2.0
DEFAULT_MAX_CONNECTIONS = 64
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_CERT_REQS = ("required", "optional", "none")


@dataclass(frozen=True, kw_only=True)
class RedisSettings:
    """Where a Valkey/Redis store is and how to talk to it; ``url`` is the masked URL."""

    url: str
    tls: bool = False
    host: str | None = None
    port: int = 6379
    unix_path: str | None = None
    nodes: tuple[tuple[str, int], ...] = ()  # a cluster's startup nodes
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ttl_seconds: int | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    wait_replicas: int = 0  # replicas that must acknowledge a write before it counts as saved (WAIT)
    wait_timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS / 2
    tls_options: tuple[tuple[str, str], ...] = ()

    def connection_kwargs(self) -> dict[str, Any]:
        """What redis-py's connection classes take (the connection class aside)."""
        kwargs: dict[str, Any] = {
            "db": self.db, "username": self.username, "password": self.password,
            "socket_timeout": self.timeout_seconds, "socket_connect_timeout": self.timeout_seconds,
        }
        if self.unix_path is not None:
            kwargs["path"] = self.unix_path
        else:
            kwargs.update(host=self.host, port=self.port)
        kwargs.update(dict(self.tls_options))
        return kwargs


def _seconds(url: str, name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise KVGroupsError(f"store URL {mask_url(url)!r}: {name}={text!r} must be a finite, positive number of "
                            f"seconds")
    return value


def _whole(url: str, name: str, text: str, minimum: int) -> int:
    if not text.isdigit() or int(text) < minimum:
        expected = ("a positive number of whole seconds (Redis expires keys in whole seconds)" if name == "ttl"
                    else f"a whole number >= {minimum}")
        raise KVGroupsError(f"store URL {mask_url(url)!r}: {name}={text!r} must be {expected}")
    return int(text)


def _cluster_nodes(url: str, netloc: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for address in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise KVGroupsError(f"store URL {mask_url(url)!r}: {address!r} is not host:port; a cluster URL lists "
                                f"its nodes as host:port[,host:port...]")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


def parse_redis_url(url: str) -> RedisSettings:
    """The settings of a ``redis://``, ``rediss://``, ``unix://`` or ``redis[s]-cluster://`` URL; bad options
    raise, naming them."""
    parts = urlsplit(url)
    unix = parts.scheme == "unix"
    tls = parts.scheme in ("rediss", "rediss-cluster")
    cluster = parts.scheme.endswith("-cluster")
    allowed = ("ttl", "timeout", "max_connections", "wait_replicas", "wait_timeout", *(("db",) if unix else ()),
               *(_TLS_OPTIONS if tls else ()))
    options = url_options(url, parts.query, allowed)
    ttl = _whole(url, "ttl", options["ttl"], 1) if "ttl" in options else None
    timeout = _seconds(url, "timeout", options["timeout"]) if "timeout" in options else DEFAULT_TIMEOUT_SECONDS
    pool = _whole(url, "max_connections", options["max_connections"], 1) if "max_connections" in options \
        else DEFAULT_MAX_CONNECTIONS
    wait_replicas = _whole(url, "wait_replicas", options["wait_replicas"], 0) if "wait_replicas" in options else 0
    wait_timeout = _seconds(url, "wait_timeout", options["wait_timeout"]) if "wait_timeout" in options \
        else timeout / 2
    if wait_timeout >= timeout:  # WAIT holds the connection: its socket must outwait it
        raise KVGroupsError(f"store URL {mask_url(url)!r}: wait_timeout={options['wait_timeout']!r} must be less "
                            f"than the connection's timeout ({timeout:g} s)")
    if options.get("ssl_cert_reqs", "required") not in _CERT_REQS:
        raise KVGroupsError(f"store URL {mask_url(url)!r}: ssl_cert_reqs={options['ssl_cert_reqs']!r}; expected "
                            f"{', '.join(_CERT_REQS)}")
    credentials = {"username": unquote(parts.username) if parts.username else None,
                   "password": unquote(parts.password) if parts.password is not None else None}
    bare = mask_url(urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")))
    common: dict[str, Any] = dict(ttl_seconds=ttl, timeout_seconds=timeout, max_connections=pool,
                                  wait_replicas=wait_replicas, wait_timeout_seconds=wait_timeout, **credentials)
    tls_options = tuple((name, value) for name, value in options.items() if name in _TLS_OPTIONS)
    if cluster:
        if parts.path.strip("/"):
            raise KVGroupsError(f"store URL {mask_url(url)!r}: a cluster has one database; no path after the nodes")
        return RedisSettings(url=bare, tls=tls, nodes=_cluster_nodes(url, parts.netloc), tls_options=tls_options,
                             **common)
    if unix:
        if not parts.path:
            raise KVGroupsError(f"store URL {mask_url(url)!r}: unix:// needs a socket path, e.g. "
                                f"unix:///run/valkey.sock")
        db = _whole(url, "db", options["db"], 0) if "db" in options else 0
        return RedisSettings(url=bare + (f"?db={db}" if db else ""), unix_path=parts.path, db=db, **common)
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise KVGroupsError(f"store URL {mask_url(url)!r}: the path must be a database number, got {parts.path!r}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise KVGroupsError(f"store URL {mask_url(url)!r}: the port is not a number") from None
    if not parts.hostname:
        raise KVGroupsError(f"store URL {mask_url(url)!r}: no host")
    return RedisSettings(url=bare, tls=tls, host=parts.hostname, port=port, db=int(database or 0),
                         tls_options=tls_options, **common)
