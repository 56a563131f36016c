"""KV tensors: ``lmcache_kv_fast.sdk.kvcache``, upstream 0.5.6's ``lmcache.sdk.kvcache``.

In 0.5.6 this module exports only :func:`connect`; the context's methods do the rest
(``ctx.retrieve``, ``ctx.store``, ``ctx.close``). The module-level functions of the older
SDK (``retrieve(ctx, ...)``, ``store(ctx, ...)``, ...) are ``lmcache_kv_fast.kvcache``.
"""

from __future__ import annotations

from typing import Any

from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.context import LMCacheSDKContext

__all__ = ["connect"]


def connect(url: str, http_url: str, model_name: str, timeout: float = 60.0,
            **options: Any) -> LMCacheSDKContext:
    """Connect to the LMCache server for the KV tensors of ``model_name``.

    Args:
        url: ZMQ URL of the server (``tcp://host:port``, ``host:port``, ``ipc://path``).
        http_url: HTTP URL of the server.
        model_name: Model whose KV is stored / retrieved.
        timeout: Seconds every server call may take.
        **options: Keyword options of :func:`lmcache_kv_fast.connect` (``layout=``, ...).

    Returns:
        A registered :class:`LMCacheSDKContext` of kind KV.
    """
    return LMCacheSDKContext(url, http_url, model_name, LMCacheSDKCacheKind.KV, timeout,
                             **options)
