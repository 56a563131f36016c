"""Query tensors: ``lmcache_kv_fast.sdk.qcache``, upstream 0.5.6's ``lmcache.sdk.qcache``.

An engine with LMCache's query capture stores the attention queries of the tokens it
computes under ``<model>##query`` (server: ``--enable transfer_query
--supported-transfer-mode auto`` up to 0.5.6, the ``qstore`` server module from 0.5.7 on,
docs/sdk.md). A QUERY context reads them as ``[1, L, T, Hq·Dh]``
with the geometry of the query registration (``/status`` ``q_context_meta``), and can
store edited ones.
"""

from __future__ import annotations

from typing import Any

from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.context import LMCacheSDKContext

__all__ = ["connect"]


def connect(url: str, http_url: str, model_name: str, timeout: float = 60.0,
            **options: Any) -> LMCacheSDKContext:
    """Connect to the LMCache server for the query tensors of ``model_name``.

    Args:
        url: ZMQ URL of the server.
        http_url: HTTP URL of the server.
        model_name: The model's name (the ``##query`` suffix is added).
        timeout: Seconds every server call may take.
        **options: Keyword options of :func:`lmcache_kv_fast.connect`; ``layout=`` gives
            the query geometry explicitly (one plane) instead of reading the query
            registration.

    Returns:
        A registered :class:`LMCacheSDKContext` of kind QUERY.

    Raises:
        QueryLayoutError: The server has no query registration for the model (the
            message says whether the server lacks the query module or no engine
            exported query tensors).
    """
    return LMCacheSDKContext(url, http_url, model_name, LMCacheSDKCacheKind.QUERY, timeout,
                             **options)
