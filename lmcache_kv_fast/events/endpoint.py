"""The server a KV-event subscription talks to: :class:`EventsEndpoint` and target helpers.

A subscription's target is an :class:`~lmcache_kv_fast.client.context.LMCacheKVCacheContext` or
an :class:`EventsEndpoint` (a server probed over HTTP without registering a KV layout).
The helpers here validate endpoint arguments and read what the stream needs of the target
(closed or used after ``fork()``, the server's reaper timeout, docs/protocol.md §3.11).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmcache_kv_fast.errors import ContextClosedError, InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.events.common import PROBE_TIMEOUT_S
from lmcache_kv_fast.hashing import HASH_ALGORITHM
from lmcache_kv_fast.protocol.constants import DEFAULT_REAP_TIMEOUT_S, FORBIDDEN_MODEL_CHARS
from lmcache_kv_fast.protocol.detect import detect_generation
from lmcache_kv_fast.protocol.mp_config import mp_chunk_size, require_transport
from lmcache_kv_fast.protocol.ops import Generation
from lmcache_kv_fast.transport.api_key import ApiKey
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.urls import parse_control_url, parse_http_url


@dataclass(frozen=True)
class EventsEndpoint:
    """What a subscription needs of a server, without a registered KV layout.

    :class:`~lmcache_kv_fast.client.context.LMCacheKVCacheContext` provides the same attributes;
    use this for a process that only watches events (``lmcache-kv-fast events``).

    Attributes:
        url: Control-plane URL ``tcp://host:port`` (or ``grpc://host:port``).
        http_url: HTTP URL ``http://host:port``.
        model_name: Model whose events are wanted.
        generation: Wire dialect of the server.
        chunk_size: Tokens per chunk (vLLM ``block_size`` of published events).
        timeout: Seconds for probes.
        reap_timeout_s: ``--worker-reap-timeout-seconds`` of the server (0 = no reaping).
        hash_algorithm: ``--hash-algorithm`` of the server.
        server_version: ``/version`` or the detected generation.
        api_key: The server's API key (hidden in every repr), or None.
    """

    url: str
    http_url: str
    model_name: str
    generation: Generation
    chunk_size: int
    timeout: float = 10.0
    reap_timeout_s: float = DEFAULT_REAP_TIMEOUT_S
    hash_algorithm: str = HASH_ALGORITHM
    server_version: str = ""
    api_key: ApiKey | None = None

    @property
    def closed(self) -> bool:
        """Always False (an endpoint has nothing to close)."""
        return False

    @classmethod
    def probe(cls, url: str, http_url: str, model_name: str,
              timeout: float = 10.0, *, api_key: str | None = None) -> EventsEndpoint:
        """Read ``/config`` and ``/version`` of a server (no ZMQ call, no registration).

        ``api_key``: a key-protected server's key (None: ``LMCACHE_API_KEY`` /
        ``LMCACHE_API_KEY_FILE``).

        Raises:
            InvalidArgumentError: A malformed URL or model name.
            KVCacheSDKError: The HTTP plane does not answer or the server is unusable.
        """
        _check_endpoint_args(url, http_url, model_name, timeout)
        http = HttpInfoClient(http_url.rstrip("/"), min(timeout, PROBE_TIMEOUT_S), api_key)
        mp = http.config()["mp"]
        chunk = mp_chunk_size(mp)
        require_transport(mp, http_url, url, parse_control_url(url).transport)
        version = http.version()
        gen, _ = detect_generation(version, mp)
        return cls(
            url=url, http_url=http_url.rstrip("/"), model_name=model_name, generation=gen,
            chunk_size=chunk, timeout=float(timeout),
            reap_timeout_s=_reap_from_mp(mp),
            hash_algorithm=str(mp.get("hash_algorithm", HASH_ALGORITHM)),
            server_version=(version or f"{gen.name} (detected)").strip('"'),
            api_key=http.api_key,
        )


def _check_endpoint_args(url: Any, http_url: Any, model_name: Any, timeout: Any) -> None:
    parse_control_url(url, "url")
    parse_http_url(http_url, "http_url")
    if not isinstance(model_name, str) or not model_name:
        raise InvalidArgumentError(f"model_name must be a non-empty str, got {model_name!r:.80}")
    if FORBIDDEN_MODEL_CHARS.intersection(model_name):
        raise InvalidArgumentError(f"model_name must not contain '@', got {model_name!r:.80}")
    check_seconds(timeout, "timeout")


def check_seconds(v: Any, what: str) -> float:
    """``v`` as float seconds; an ``InvalidArgumentError`` naming ``what`` unless positive and finite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise InvalidArgumentError(f"{what} must be a positive number of seconds, got {v!r}")
    return float(v)


def _reap_from_mp(mp: dict[str, Any]) -> float:
    v = mp.get("worker_reap_timeout_seconds", DEFAULT_REAP_TIMEOUT_S)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return DEFAULT_REAP_TIMEOUT_S
    return float(v)


def target_closed(target: Any) -> bool:
    """Whether the subscription's context (or endpoint) is closed."""
    try:
        return bool(getattr(target, "closed", False))
    except Exception:  # a half-torn-down context counts as closed
        return True


def target_reap_timeout(target: Any) -> float:
    """The server's worker reap timeout for ``target`` (its ``/config``, else the default)."""
    reap = getattr(target, "reap_timeout_s", None)
    if isinstance(reap, (int, float)) and not isinstance(reap, bool):
        return float(reap)
    try:
        mp = HttpInfoClient(target.http_url, PROBE_TIMEOUT_S,
                            getattr(target, "api_key", None)).config()["mp"]
    except (KVCacheSDKError, AttributeError, KeyError, TypeError):
        return DEFAULT_REAP_TIMEOUT_S
    return _reap_from_mp(mp)


def check_target(target: Any) -> None:
    """Refuse a closed target or one used after ``fork()`` (before anything is created).

    Raises:
        ContextClosedError: ``target`` is closed.
        KVCacheSDKError: It belongs to another process.
    """
    check_process = getattr(target, "_check_process", None)
    if check_process is not None:
        check_process()
    if target_closed(target):
        raise ContextClosedError(f"the SDK context for {target.url} is closed")
