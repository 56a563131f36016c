"""``import lmcache_kv_fast.sdk as lmc_sdk``: the whole ``lmcache.sdk`` package of LMCache 0.5.6.

Replace ``import lmcache.sdk as lmc_sdk`` with this line and keep the program::

    ctx = lmc_sdk.connect(lmc_sdk.LMCacheSDKCacheKind.KV, url, http_url, model)
    stream = lmc_sdk.request.create_request([ctx], post_completion, prompt_ids)
    batch = lmc_sdk.batch.LMCacheBatchedStream()
    batch.add(stream)
    batch.prefill({"temperature": 0.0}).emit()
    batch.modify(drop_tokens).emit()
    batch.decode({"max_tokens": 64, "temperature": 0.0}).emit()

Modules: :mod:`~lmcache_kv_fast.sdk.kvcache` and :mod:`~lmcache_kv_fast.sdk.qcache`
(``connect``), :mod:`~lmcache_kv_fast.sdk.context` (``LMCacheSDKContext``,
``LMCacheSDKError``, ``ModifyFnType``), :mod:`~lmcache_kv_fast.sdk.request` (request
streams), :mod:`~lmcache_kv_fast.sdk.batch` (the batched stream), plus
:mod:`~lmcache_kv_fast.sdk.hooks` (ready ``post_completion`` engine hooks) and
:mod:`~lmcache_kv_fast.sdk.metrics`. What differs from 0.5.6 and why: docs/sdk.md.
"""

from __future__ import annotations

from typing import Any

from lmcache_kv_fast.errors import LMCacheSDKError
from lmcache_kv_fast.sdk import batch, context, hooks, kvcache, metrics, qcache, request
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.context import LMCacheSDKContext, ModifyFnType, as_kind

__all__ = [
    "LMCacheSDKCacheKind",
    "LMCacheSDKContext",
    "LMCacheSDKError",
    "ModifyFnType",
    "batch",
    "connect",
    "context",
    "hooks",
    "kvcache",
    "metrics",
    "qcache",
    "request",
]


def connect(kind: LMCacheSDKCacheKind, url: str, http_url: str, model_name: str,
            timeout: float = 60.0, **options: Any) -> LMCacheSDKContext:
    """Connect to the LMCache server for one kind of cached tensors.

    Calls :func:`kvcache.connect` or :func:`qcache.connect` according to ``kind``.

    Args:
        kind: ``LMCacheSDKCacheKind.KV`` or ``.QUERY``.
        url: ZMQ URL of the server (``tcp://host:port``, ``host:port``, ``ipc://path``).
        http_url: HTTP URL of the server.
        model_name: The model's name.
        timeout: Seconds every server call may take.
        **options: Keyword options of :func:`lmcache_kv_fast.connect`.

    Returns:
        A registered :class:`LMCacheSDKContext`.

    Raises:
        InvalidArgumentError: ``kind`` is not a cache kind (also a ``ValueError``, as in
            0.5.6).
        LMCacheSDKError: The server cannot be used.
    """
    k = as_kind(kind)
    if k is LMCacheSDKCacheKind.QUERY:
        return qcache.connect(url, http_url, model_name, timeout, **options)
    return kvcache.connect(url, http_url, model_name, timeout, **options)
