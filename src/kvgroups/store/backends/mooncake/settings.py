"""A Mooncake Store tier's settings, read from its URL once and checked, every wrong option named at once.

``mooncake://MASTER_HOST[:PORT]`` (the master's RPC port, 50051 by default) takes:

- ``metadata=``: where transfer engines find each other: ``P2PHANDSHAKE`` (the default: peers handshake
  directly, no metadata server) or the master's HTTP metadata server, ``http://HOST:PORT/metadata``
  (``mooncake_master --enable_http_metadata_server=true``);
- ``segment=``: the memory this process lends to the pool (``1GiB`` by default; ``0`` lends none: it
  reads and writes the segments other clients lend). What a process lends leaves the pool with it;
- ``buffer=``: the client's own transfer buffer (``16MiB``; values move from and into kvgroups' buffers,
  not through it);
- ``protocol=``: ``tcp`` (the default) or ``rdma``, with ``device=`` naming the RDMA devices
  (``mlx5_0,mlx5_1``);
- ``local_host=``: the address other clients reach this one at (by default the address this host
  reaches the master from);
- ``replicas=``: copies of each entry, on as many clients' segments (1 by default);
- ``timeout=``: seconds any call may take (2 by default): a master that is down or hung costs a miss,
  not Mooncake's own 30 s RPC timeout;
- ``admin=``: the master's admin HTTP server, which lists keys for ``kvgroups store stats`` and
  ``verify`` (``http://MASTER_HOST:9003``, ``mooncake_master --metrics_port``).
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from kvgroups.core.sizes import GIB, MIB, parse_size
from kvgroups.errors import KVGroupsError
from kvgroups.store.backends.url_parts import url_options

DEFAULT_MASTER_PORT = 50051
DEFAULT_ADMIN_PORT = 9003
DEFAULT_SEGMENT_BYTES = 1 * GIB
DEFAULT_BUFFER_BYTES = 16 * MIB
DEFAULT_TIMEOUT_SECONDS = 2.0
P2P_HANDSHAKE = "P2PHANDSHAKE"
PROTOCOLS = ("tcp", "rdma")
_OPTIONS = ("metadata", "segment", "buffer", "protocol", "device", "local_host", "replicas", "timeout", "admin")


@dataclass(frozen=True, kw_only=True)
class MooncakeSettings:
    """Where a Mooncake Store is and what this client lends it; ``url`` is the URL as given, checked."""

    url: str
    master: str  # host:port of the master's RPC service
    metadata: str = P2P_HANDSHAKE
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    protocol: str = "tcp"
    devices: str = ""
    local_host: str = ""
    replicas: int = 1
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    admin: str = ""

    def client_host(self) -> str:
        """The address other clients reach this one at: the one given, else this host's address towards the
        master (no packet is sent: a UDP socket's connect only picks the route)."""
        if self.local_host:
            return self.local_host
        host, _, port = self.master.rpartition(":")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, int(port)))
                address: str = probe.getsockname()[0]
                return address
        except OSError:
            return "127.0.0.1" if host in ("localhost", "127.0.0.1") else socket.gethostname()


def parse_mooncake_url(url: str) -> MooncakeSettings:
    """The settings a ``mooncake://`` URL names; every bad part raises at once, each named with what it takes."""
    parts = urlsplit(url)
    problems: list[str] = []
    options = url_options(url, parts.query, _OPTIONS)
    try:
        port = parts.port or DEFAULT_MASTER_PORT
    except ValueError:
        problems.append("the master's port is not a number")
        port = DEFAULT_MASTER_PORT
    host = parts.hostname or ""
    if not host:
        problems.append("no master host: mooncake://MASTER_HOST:PORT (the master's RPC port, 50051 by default)")
    if parts.username or parts.password:
        problems.append("a Mooncake master takes no user or password")
    if parts.path.strip("/"):
        problems.append(f"no path after the master, got {parts.path!r}")

    def size(name: str, default: int, minimum: int) -> int:
        if name not in options:
            return default
        try:
            value = parse_size(options[name], name)
        except KVGroupsError as error:
            problems.append(str(error))
            return default
        if value < minimum:
            problems.append(f"{name}={options[name]!r} must be at least {minimum} bytes")
        return value

    segment = size("segment", DEFAULT_SEGMENT_BYTES, 0)
    buffer = size("buffer", DEFAULT_BUFFER_BYTES, 1 * MIB)
    metadata = options.get("metadata", P2P_HANDSHAKE)
    if metadata != P2P_HANDSHAKE and urlsplit(metadata).scheme not in ("http", "https"):
        problems.append(f"metadata={metadata!r}; expected {P2P_HANDSHAKE} or the master's HTTP metadata server, "
                        f"http://HOST:PORT/metadata")
    protocol = options.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        problems.append(f"protocol={protocol!r}; expected {' or '.join(PROTOCOLS)}")
    devices = options.get("device", "")
    if devices and protocol != "rdma":
        problems.append(f"device={devices!r} names RDMA devices: it takes protocol=rdma")
    replicas_text = options.get("replicas", "1")
    if not replicas_text.isdigit() or int(replicas_text) < 1:
        problems.append(f"replicas={replicas_text!r} must be a whole number >= 1")
    timeout_text = options.get("timeout", str(DEFAULT_TIMEOUT_SECONDS))
    try:
        timeout = float(timeout_text)
    except ValueError:
        timeout = math.nan
    if not (math.isfinite(timeout) and timeout > 0):
        problems.append(f"timeout={timeout_text!r} must be a finite, positive number of seconds")
    admin = options.get("admin", f"http://{host}:{DEFAULT_ADMIN_PORT}" if host else "")
    if admin and urlsplit(admin).scheme not in ("http", "https"):
        problems.append(f"admin={admin!r}; expected the master's admin server, http://HOST:PORT")
    if problems:
        raise KVGroupsError(f"store URL {url!r}: " + "; ".join(problems))
    return MooncakeSettings(
        url=urlunsplit((parts.scheme, parts.netloc, parts.path, parts.query, "")), master=f"{host}:{port}",
        metadata=metadata, segment_bytes=segment, buffer_bytes=buffer, protocol=protocol, devices=devices,
        local_host=options.get("local_host", ""), replicas=int(replicas_text), timeout_seconds=timeout, admin=admin)
