"""lmcache-kv-fast: a fast, CPU-only SDK for the LMCache multiprocess server.

A drop-in for ``lmcache.sdk.kvcache`` (``connect / retrieve / store / close``) with a C++
data plane. It never imports ``lmcache``.
"""

from __future__ import annotations

from lmcache_kv_fast.client.context import LMCacheKVCacheContext, OpTiming, StoreResult
from lmcache_kv_fast.copy.select import backend_name as _backend_name
from lmcache_kv_fast.errors import (
    ConnectionLostError,
    ContextClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
    LMCacheSDKError,
    MissingExtraError,
    ProtocolError,
    ServerError,
    ServerTimeoutError,
    ServerUnavailableError,
)
from lmcache_kv_fast.kvcache import close, connect, lookup, retrieve, store, store_ex
from lmcache_kv_fast.layout import KVLayout

__version__ = "0.1.0"

__all__ = [
    "ConnectionLostError",
    "ContextClosedError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "KVCacheSDKError",
    "KVLayout",
    "LMCacheKVCacheContext",
    "LMCacheSDKError",
    "MissingExtraError",
    "OpTiming",
    "ProtocolError",
    "ServerError",
    "ServerTimeoutError",
    "ServerUnavailableError",
    "StoreResult",
    "__version__",
    "backend",
    "close",
    "connect",
    "lookup",
    "retrieve",
    "store",
    "store_ex",
]


def backend() -> str:
    """Return the live copy backend: ``"native"`` or ``"torch"``."""
    return _backend_name()
