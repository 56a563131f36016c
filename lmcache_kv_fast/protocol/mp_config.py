"""The server's ``GET /config`` ``mp`` section: the fields every client of it must check.

Pure functions of the decoded reply (docs/protocol.md §5.1); the handshake of a context,
the events endpoint and the sdk package's query geometry read the same fields the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError

__all__ = ["live_chunk_size", "mp_chunk_size", "require_transport", "require_zmq_transport"]


def mp_chunk_size(mp: Mapping[str, Any]) -> int:
    """``mp.chunk_size``: tokens per chunk of the server.

    Raises:
        ProtocolError: It is missing or not a positive int.
    """
    v = mp.get("chunk_size")
    if type(v) is not int or v <= 0:
        raise ProtocolError(f"/config mp.chunk_size: expected a positive integer, got {v!r:.60}")
    return v


def live_chunk_size(status: Mapping[str, Any], configured: int) -> int:
    """The chunk size the server uses now: ``/status`` ``chunk_size`` when it has one.

    A 0.5.7 server rounds ``--chunk-size`` up when an engine negotiates an alignment; its
    ``/config`` keeps the configured value, ``/status`` has the live one. Reading it does
    not freeze it (``get_chunk_size`` would).

    Raises:
        ProtocolError: ``/status`` has a ``chunk_size`` that is not a positive int.
    """
    v = status.get("chunk_size") if isinstance(status, Mapping) else None
    if v is None:
        return configured
    if type(v) is not int or v <= 0:
        raise ProtocolError(f"/status chunk_size: expected a positive integer, got {v!r:.60}")
    return v


def require_transport(mp: Mapping[str, Any], http_url: str, url: str, transport: str) -> None:
    """Refuse a server whose control plane (``mp.transport``) is not the URL's.

    A server listens on ZMQ or on gRPC, never both (0.5.6+); a request in the other
    transport would only time out, so the mismatch is named at once.

    Args:
        mp: ``/config`` ``mp`` section.
        http_url: The server's HTTP URL (for the message).
        url: The control-plane URL the caller gave.
        transport: ``"zmq"`` or ``"grpc"``, the transport of ``url``.

    Raises:
        KVCacheSDKError: The server uses the other transport.
    """
    theirs = mp.get("transport", "zmq")
    if theirs == transport:
        return
    hint = {"grpc": "grpc://host:port", "zmq": "tcp://host:port"}.get(str(theirs))
    raise KVCacheSDKError(
        f"the server at {http_url} serves transport {theirs!r} (/config mp.transport) but "
        f"url {url!r} is a {transport} URL"
        + (f": connect with a {theirs} URL ({hint})" if hint else
           "; this SDK speaks the zmq and grpc transports")
    )


def require_zmq_transport(mp: Mapping[str, Any], http_url: str) -> None:
    """Refuse a server whose control plane is not ZMQ (``mp.transport``, 0.5.5+).

    Raises:
        KVCacheSDKError: The server uses another transport.
    """
    if mp.get("transport", "zmq") != "zmq":
        raise KVCacheSDKError(
            f"the server at {http_url} uses transport {mp.get('transport')!r}; "
            "this SDK speaks the ZMQ transport"
        )
