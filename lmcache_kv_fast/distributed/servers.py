"""The servers of a fleet: addresses, names, and the Ray node that hosts each one.

A :class:`Server` names one LMCache MP server: its ZMQ URL, its HTTP URL and the Ray node
its actor must run on (so the copies go through that node's shared memory). ``node`` is a
Ray node id (hex) or a node IP; by default it is the node whose IP the ZMQ URL names (a
loopback URL means the driver's own node).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError

_CONTROL_URL = re.compile(r"^(tcp|grpc)://[^\s/:]+:\d{1,5}$")
_HTTP_URL = re.compile(r"^https?://[^\s/]+(:\d{1,5})?/?$")


@dataclass(frozen=True)
class Server:
    """One LMCache MP server of the fleet.

    Attributes:
        url: Control URL, ``tcp://host:port`` (ZMQ) or ``grpc://host:port`` (gRPC, a server
            started with ``--transport grpc``).
        http_url: HTTP URL, ``http://host:port``.
        node: Ray node id (hex) or node IP that hosts the server; None: the node whose IP
            ``url`` names (loopback: the driver's node).
        name: Name used in reports and errors (default: ``url``).
    """

    url: str
    http_url: str
    node: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not _CONTROL_URL.match(self.url):
            raise InvalidArgumentError(
                f"Server.url must look like tcp://host:port or grpc://host:port, got {self.url!r}"
            )
        if not isinstance(self.http_url, str) or not _HTTP_URL.match(self.http_url):
            raise InvalidArgumentError(
                f"Server.http_url must look like http://host:port, got {self.http_url!r}"
            )
        if self.node is not None and (not isinstance(self.node, str) or not self.node):
            raise InvalidArgumentError(f"Server.node must be a node id or IP string, got {self.node!r}")
        if not isinstance(self.name, str):
            raise InvalidTypeError(f"Server.name must be a str, got {type(self.name).__name__}")
        if not self.name:
            object.__setattr__(self, "name", self.url)

    @property
    def host(self) -> str:
        """The host part of the control URL."""
        return urlparse("http://" + self.url.partition("://")[2]).hostname or ""


def as_servers(servers: Any) -> list[Server]:
    """Normalize ``servers`` to a list of :class:`Server` with unique names.

    Accepts :class:`Server` objects, mappings with the same keys, and ``(url, http_url)``
    or ``(url, http_url, node)`` tuples, in any iterable.

    Raises:
        InvalidArgumentError: Empty, malformed, or two servers with one name or URL.
    """
    if isinstance(servers, (str, bytes, Server, Mapping)) or not isinstance(servers, Iterable):
        raise InvalidTypeError(
            f"servers must be a list of Server / dict / (url, http_url[, node]) tuples, "
            f"got {type(servers).__name__}"
        )
    out: list[Server] = []
    for i, s in enumerate(servers):
        if isinstance(s, Server):
            out.append(s)
        elif isinstance(s, Mapping):
            try:
                out.append(Server(**s))
            except TypeError as err:
                raise InvalidArgumentError(f"servers[{i}]: {err}") from err
        elif isinstance(s, (tuple, list)) and len(s) in (2, 3):
            out.append(Server(*s))
        else:
            raise InvalidTypeError(
                f"servers[{i}] must be a Server, a dict or a (url, http_url[, node]) tuple, "
                f"got {s!r}"
            )
    if not out:
        raise InvalidArgumentError("servers is empty: a fleet needs at least one server")
    for attr in ("name", "url"):
        seen: set[str] = set()
        for s in out:
            v = getattr(s, attr)
            if v in seen:
                raise InvalidArgumentError(f"two servers have the same {attr} {v!r}")
            seen.add(v)
    return out


def _ip_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def resolve_node(server: Server, nodes: list[dict[str, Any]], driver_node: str | None) -> str | None:
    """The Ray node id ``server``'s actor must run on, or None (anywhere: remote server).

    Args:
        server: The server.
        nodes: ``ray.nodes()`` (alive entries are used).
        driver_node: The driver's node id (for loopback URLs and ambiguous IPs).

    Raises:
        InvalidArgumentError: ``server.node`` names no live node, or an IP that several
            nodes share while none of them is the driver's (say which with a node id).
    """
    alive = [n for n in nodes if n.get("Alive")]
    ids = {str(n["NodeID"]) for n in alive}
    if server.node is not None and server.node in ids:
        return server.node
    ip = server.node if server.node is not None else _ip_of(server.host)
    if server.node is None and _is_loopback(ip):
        return driver_node
    matches = [str(n["NodeID"]) for n in alive if n.get("NodeManagerAddress") == ip]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        if driver_node in matches:
            return driver_node
        raise InvalidArgumentError(
            f"server {server.name!r}: {len(matches)} Ray nodes have IP {ip}; name the node "
            f"with Server(node=<node id>) (one of {sorted(matches)})"
        )
    if server.node is not None:
        raise InvalidArgumentError(
            f"server {server.name!r}: node {server.node!r} is neither the id nor the IP of a "
            f"live Ray node"
        )
    return None  # not a Ray node: the actor runs anywhere and talks to it remotely
