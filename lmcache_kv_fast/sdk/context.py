"""The 0.5.6 SDK context: one connection for one cache kind (KV or query tensors).

:class:`LMCacheSDKContext` has the members of upstream's ``lmcache.sdk.context``
that programs use (``kind``, ``chunk_size``, ``mq_timeout``, ``instance_id``,
``register_caches()``, ``retrieve``, ``store``, ``close``) over this project's context
(:class:`~lmcache_kv_fast.client.context.LMCacheKVCacheContext`, reachable as
``ctx.kv_context``), which does the work: SHM or pickle data plane, liveness pings,
integrity checks.

Shapes are upstream's: KV ``[2, L, T, D]`` (one-plane KV, e.g. MLA: ``[L, T, D]``, which
is also what 0.5.6 returns for it), query tensors ``[1, L, T, Hq·Dh]``. ``store`` takes
those shapes, and ``[L, T, D]`` for query tensors too.

Differences from 0.5.6, on purpose:

* the constructor connects and registers (0.5.6 registers in ``register_caches()``, which
  :func:`~lmcache_kv_fast.sdk.kvcache.connect` calls); ``register_caches()`` is kept and
  does nothing on a registered context, so code written either way works;
* query geometry comes from the query registration (``/status`` ``q_context_meta``), not
  from the KV registration (see :mod:`lmcache_kv_fast.sdk._qlayout`);
* ``store`` refuses a tensor of another dtype than the model's instead of casting it
  silently; ``close()`` unregisters (0.5.6 leaves that to the server's reaper).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.client.handshake import CONNECT_PROBE_TIMEOUT_S
from lmcache_kv_fast.errors import (
    ContextClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    LMCacheSDKError,
)
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.protocol.mp_config import live_chunk_size, mp_chunk_size
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.sdk._qlayout import query_layout
from lmcache_kv_fast.sdk._urls import normalize_request_url
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.validation import check_connect_args

logger = logging.getLogger(__name__)

__all__ = [
    "LMCacheSDKCacheKind",
    "LMCacheSDKContext",
    "LMCacheSDKError",
    "ModifyFnType",
    "as_kind",
]

#: ``fn({kind: tensor}, tokens) -> (new_kv, new_tokens)``: an edit of a stream's cache
#: (upstream's type; see :meth:`LMCacheBatchedStream.modify`).
ModifyFnType = Callable[
    [Mapping[LMCacheSDKCacheKind, torch.Tensor], Sequence[int]],
    tuple[torch.Tensor, Sequence[int]],
]


def as_kind(kind: Any) -> LMCacheSDKCacheKind:
    """``kind`` as a :class:`LMCacheSDKCacheKind` (also accepts ``"kv"`` / ``"query"``).

    Raises:
        InvalidArgumentError: Anything else (it is also a ``ValueError``, what 0.5.6's
            ``connect`` raises for an unsupported kind).
    """
    if isinstance(kind, LMCacheSDKCacheKind):
        return kind
    if isinstance(kind, str):
        with contextlib.suppress(ValueError):
            return LMCacheSDKCacheKind(kind.lower())
    raise InvalidArgumentError(
        f"unsupported cache kind: expected LMCacheSDKCacheKind.KV or .QUERY, got {kind!r:.80}"
    )


class LMCacheSDKContext:
    """Retrieve and store one kind of cached tensors of one model.

    Create it with ``lmcache_kv_fast.sdk.connect(kind, ...)``,
    ``sdk.kvcache.connect(...)`` or ``sdk.qcache.connect(...)``. Safe to share between
    threads (the streams of a batch do).

    Args:
        url: ZMQ URL of the server: ``tcp://host:port``, ``host:port`` or ``ipc://path``.
        http_url: HTTP URL of the server.
        model_name: The model's name (without ``##query``).
        kind: ``LMCacheSDKCacheKind.KV`` or ``.QUERY``.
        timeout: Seconds every server call may take.
        **options: Keyword options of :func:`lmcache_kv_fast.connect` (``layout``,
            ``world_size``, ``copy_threads``, ``heartbeat``, ``read_hints``, and those for
            a CPU engine's geometry). For QUERY, ``layout`` overrides the query
            registration's geometry.

    Raises:
        LMCacheSDKError: The server cannot be used (the message says why).
    """

    def __init__(self, url: str, http_url: str, model_name: str,
                 kind: LMCacheSDKCacheKind = LMCacheSDKCacheKind.KV, timeout: float = 60.0,
                 **options: Any) -> None:
        self._kind = as_kind(kind)
        if not isinstance(model_name, str) or not model_name:
            raise InvalidArgumentError(
                f"model_name must be a non-empty str, got {model_name!r:.80}")
        self._model_name = self._kind.base_model_name(model_name)
        self._url = normalize_request_url(url)
        check_connect_args(self._url, http_url, self._kind.server_model_name(self._model_name),
                           timeout, options.get("world_size"), options.get("copy_threads"))
        self._http_url = http_url
        self._timeout = timeout
        self._options = dict(options)
        self._kv: LMCacheKVCacheContext | None = None
        self._closed = False
        self.register_caches()

    # ------------------------------------------------------------------ connecting
    def register_caches(self) -> None:
        """Register this context with the server (done by the constructor already).

        Kept for 0.5.6 programs that build the context and then call it; on a registered
        context it does nothing.

        Raises:
            ContextClosedError: The context was closed.
            LMCacheSDKError: The server cannot be used.
        """
        if self._closed:
            raise ContextClosedError(f"the {self._kind.value} context for {self._url} is closed")
        if self._kv is not None:
            return
        opts = dict(self._options)
        name = self.server_model_name
        if self._kind is LMCacheSDKCacheKind.QUERY and opts.get("layout") is None:
            opts["layout"], ws = self._query_geometry(name)
            opts.setdefault("world_size", ws)
        self._kv = LMCacheKVCacheContext(self._url, self._http_url, name, self._timeout, **opts)

    def _query_geometry(self, name: str) -> tuple[KVLayout, int]:
        http = HttpInfoClient(self._http_url.rstrip("/"), min(float(self._timeout),
                                                               CONNECT_PROBE_TIMEOUT_S),
                              self._options.get("api_key"))
        status = http.status()
        chunk = live_chunk_size(status, mp_chunk_size(http.config()["mp"]))
        return query_layout(status, name, chunk, self._http_url)

    @property
    def kv_context(self) -> LMCacheKVCacheContext:
        """The underlying context of this SDK (lookup, ``store_ex``, ``out=`` buffers, ...)."""
        if self._kv is None:
            raise ContextClosedError("the context is not registered (register_caches())")
        return self._kv

    # ------------------------------------------------------------------ properties
    @property
    def kind(self) -> LMCacheSDKCacheKind:
        """The tensor family this context serves."""
        return self._kind

    @property
    def model_name(self) -> str:
        """The model's name (without ``##query``)."""
        return self._model_name

    @property
    def server_model_name(self) -> str:
        """The model name the objects are stored under (``<model>##query`` for QUERY)."""
        return self._kind.server_model_name(self._model_name)

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk of the server."""
        return self.kv_context.chunk_size

    @property
    def mq_timeout(self) -> float:
        """Seconds every server call may take."""
        return float(self._timeout)

    @property
    def instance_id(self) -> int:
        """This client's instance id on the server."""
        return self.kv_context.instance_id

    @property
    def layout(self) -> KVLayout:
        """Geometry of the tensors of this kind (query tensors: one plane; CPU engine: per token)."""
        return self.kv_context.layout

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the tensors."""
        return self.kv_context.dtype

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def tensor_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape :meth:`retrieve` returns for ``tokens`` tokens."""
        shape = tuple(self.kv_context.kv_shape(tokens))
        return (1, *shape) if self._kind is LMCacheSDKCacheKind.QUERY and len(shape) == 3 \
            else shape

    # ------------------------------------------------------------------ operations
    def lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Leading tokens of ``tokens`` that are cached (whole chunks), moving no data."""
        return self.kv_context.lookup(tokens, cache_salt)

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "",
                 request_configs: dict[str, object] | None = None, **kwargs: Any
                 ) -> torch.Tensor | None:
        """Retrieve the cached prefix of ``tokens``.

        Args:
            tokens: Token ids from position 0 (a trailing partial chunk is ignored).
            cache_salt: Per-user isolation salt.
            request_configs: LMCache request configs passed through in the keys.
            **kwargs: Keyword options of ``LMCacheKVCacheContext.retrieve`` (``out=``).

        Returns:
            KV ``[2, L, hit, D]`` (``[L, hit, D]`` for one-plane KV), query tensors
            ``[1, L, hit, Hq·Dh]``; None when fewer than one chunk is given or nothing is
            cached.
        """
        got = self.kv_context.retrieve(tokens, cache_salt, request_configs=request_configs,
                                       **kwargs)
        if got is not None and self._kind is LMCacheSDKCacheKind.QUERY and got.dim() == 3:
            got = got.unsqueeze(0)
        return got

    def store(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "",
              request_configs: dict[str, object] | None = None, **kwargs: Any) -> bool:
        """Store ``kv`` under ``tokens`` (both truncated to whole chunks).

        Args:
            kv: ``[2, L, T, D]`` KV, ``[L, T, D]`` one-plane KV, or query tensors
                ``[1, L, T, D]`` / ``[L, T, D]``, of the model's dtype.
            tokens: The ``T`` token ids.
            cache_salt: Per-user isolation salt.
            request_configs: LMCache request configs passed through in the keys.
            **kwargs: Keyword options of ``LMCacheKVCacheContext.store``.

        Returns:
            True when every whole chunk is cached afterwards (written now or already
            there); False when fewer than one chunk was given or a chunk was refused.

        Raises:
            LMCacheSDKError: Bad arguments (``len(tokens)`` differs from the tensor's
                token dimension, wrong shape or dtype), or the server failed.
        """
        return self.store_ex(kv, tokens, cache_salt, request_configs, **kwargs).ok

    def store_ex(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "",
                 request_configs: dict[str, object] | None = None, **kwargs: Any
                 ) -> StoreResult:
        """Store like :meth:`store` and say what happened to every chunk."""
        if not isinstance(kv, torch.Tensor):
            raise InvalidTypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        return self.kv_context.store_ex(kv, tokens, cache_salt, request_configs=request_configs,
                                        **kwargs)

    def to_server(self, kv: torch.Tensor, tokens: Sequence[int]
                  ) -> tuple[torch.Tensor, Sequence[int]]:
        """``(kv, tokens)`` as :attr:`kv_context` stores them: unchanged.

        The core context converts a CPU engine's per-token K/V to the engine's rows itself.
        """
        return kv, tokens

    def close(self) -> None:
        """Unregister and release this context's resources. Idempotent."""
        self._closed = True
        if self._kv is not None:
            self._kv.close()  # idempotent; properties stay readable, operations then raise

    def __enter__(self) -> LMCacheSDKContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"LMCacheSDKContext(kind={self._kind.value}, model={self._model_name!r}, "
                f"url={self._url!r}, {state})")
