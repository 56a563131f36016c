"""Drop-in replacement for ``lmcache.sdk.kvcache``.

``import lmcache_kv_fast.kvcache as lmc_sdk`` and keep the upstream code::

    ctx = lmc_sdk.connect(url, http_url, model_name)
    kv = lmc_sdk.retrieve(ctx, tokens)          # [2, L, hit, D] or None
    ok = lmc_sdk.store(ctx, kv, tokens)         # bool
    lmc_sdk.close(ctx)

The same flows are methods of the context (``ctx.retrieve``, ``ctx.store``, ``ctx.close``),
the 0.5.6 style.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_kv_fast.client.context import LMCacheKVCacheContext, StoreResult
from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.layout import KVLayout

__all__ = [
    "KVCacheSDKError",
    "KVLayout",
    "LMCacheKVCacheContext",
    "StoreResult",
    "close",
    "connect",
    "lookup",
    "retrieve",
    "store",
    "store_ex",
]


def connect(
    url: str,
    http_url: str,
    model_name: str,
    timeout: float = 60.0,
    *,
    layout: KVLayout | None = None,
    world_size: int | None = None,
    copy_threads: int | None = None,
    heartbeat: bool = True,
    read_hints: bool = True,
    model_config: Any = None,
    block_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    kernel: str | None = None,
    api_key: str | None = None,
) -> LMCacheKVCacheContext:
    """Connect to an LMCache MP server and register this SDK instance.

    Args:
        url: Control URL, ``tcp://host:port`` (ZMQ) or ``grpc://host:port`` (gRPC).
        http_url: HTTP URL, ``http://host:port``.
        model_name: Model whose KV is stored/retrieved.
        timeout: Seconds every server call may take (connect probes use at most 5 s).
        layout: Explicit geometry of the server's objects (:class:`KVLayout`); None: the
            vLLM registration, or a CPU engine's (per-token K/V, docs/engine-kv-layout.md).
        world_size: Tensor-parallel KV shards of the model.
        copy_threads: Native copy threads (default: ``LMCACHE_KV_FAST_THREADS`` or cores).
        heartbeat: Keep the registration alive with pings while the context is open.
        read_hints: On an SHM server, copy a repeated prefix from where it lay last time
            while ``prepare_retrieve`` is answered; only chunks the reply confirms are
            kept (docs/read-hints.md).
        model_config: A CPU engine's configuration (dir, ``config.json``, dict).
        block_size: A CPU engine's vLLM block size when it cannot be read.
        dtype: A CPU engine's KV dtype when it differs from the configuration's.
        kernel: A CPU engine's attention kernel when it runs on another machine.
        api_key: A key-protected server's API key (LMCache 0.5.7+; None:
            ``LMCACHE_API_KEY[_FILE]``), sent on every HTTP request, never logged.

    Returns:
        A connected context.

    Raises:
        KVCacheSDKError: The server is unreachable, misconfigured or does not know the model.
    """
    return LMCacheKVCacheContext(
        url, http_url, model_name, timeout, layout=layout, world_size=world_size,
        copy_threads=copy_threads, heartbeat=heartbeat, read_hints=read_hints,
        model_config=model_config, block_size=block_size, dtype=dtype, kernel=kernel,
        api_key=api_key,
    )


def retrieve(
    ctx: LMCacheKVCacheContext,
    tokens: Sequence[int],
    cache_salt: str = "",
    *,
    out: torch.Tensor | None = None,
    request_configs: dict | None = None,
    raw: bool = False,
) -> torch.Tensor | None:
    """Retrieve the KV of the cached prefix of ``tokens`` (see ``ctx.retrieve``).

    Per-token K/V for a CPU engine unless ``raw`` (the engine's rows).
    """
    return ctx.retrieve(tokens, cache_salt, out=out, request_configs=request_configs, raw=raw)


def store(
    ctx: LMCacheKVCacheContext,
    kv: torch.Tensor,
    tokens: Sequence[int],
    cache_salt: str = "",
    *,
    request_configs: dict | None = None,
    raw: bool = False,
) -> bool:
    """Store ``kv`` under ``tokens``; True when every whole chunk is cached afterwards.

    For a CPU engine ``kv`` is per-token K/V unless ``raw`` (the engine's rows).
    """
    return ctx.store(kv, tokens, cache_salt, request_configs=request_configs, raw=raw)


def store_ex(
    ctx: LMCacheKVCacheContext,
    kv: torch.Tensor,
    tokens: Sequence[int],
    cache_salt: str = "",
    *,
    request_configs: dict | None = None,
    raw: bool = False,
) -> StoreResult:
    """Store and report per-chunk outcomes (see ``ctx.store_ex``)."""
    return ctx.store_ex(kv, tokens, cache_salt, request_configs=request_configs, raw=raw)


def lookup(ctx: LMCacheKVCacheContext, tokens: Sequence[int], cache_salt: str = "") -> int:
    """Number of leading cached tokens of ``tokens`` (no data moved)."""
    return ctx.lookup(tokens, cache_salt)


def close(ctx: LMCacheKVCacheContext) -> None:
    """Close the context (idempotent)."""
    ctx.close()
