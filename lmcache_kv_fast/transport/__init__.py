"""Transports: the control-plane clients (ZMQ, gRPC) and the HTTP info client.

:func:`open_control` picks the client from the URL's scheme; both have the same surface
(``ZmqClient`` / ``Channel`` and ``GrpcClient`` / ``GrpcChannel``), so the flows do not
know which one they use. ``grpc`` is only imported for a gRPC URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache_kv_fast.protocol.ops import Generation
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.urls import parse_control_url
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall, ZmqClient

if TYPE_CHECKING:
    from lmcache_kv_fast.transport.grpc_client import GrpcClient

__all__ = ["Channel", "HttpInfoClient", "PendingCall", "ZmqClient", "control_transport",
           "open_control"]


def control_transport(url: Any, what: str = "url") -> str:
    """``"zmq"`` or ``"grpc"``: the transport a control-plane URL names.

    Raises:
        InvalidArgumentError: ``url`` is not a control-plane URL (``transport/urls.py``).
        MissingExtraError: A gRPC URL without grpcio installed.
    """
    transport = parse_control_url(url, what).transport
    if transport == "grpc":
        from lmcache_kv_fast.transport.grpc_client import require_grpc

        require_grpc()
    return transport


def open_control(url: str, generation: Generation, timeout: float) -> ZmqClient | GrpcClient:
    """The control-plane client of ``url``: ``ZmqClient`` (tcp, ipc) or ``GrpcClient``.

    Raises:
        InvalidArgumentError: ``url`` is not a control-plane URL.
        MissingExtraError: A gRPC URL without grpcio installed.
        KVCacheSDKError: A gRPC URL for a server generation without a gRPC dialect.
    """
    if parse_control_url(url).transport == "grpc":
        from lmcache_kv_fast.transport.grpc_client import GrpcClient

        return GrpcClient(url, generation, timeout)
    return ZmqClient(url, generation, timeout)
