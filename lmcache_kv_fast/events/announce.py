"""SDK store announcements: listeners keyed by model name, and the server's chunk hashes.

The server records no ``stored`` event for engine-driven (SDK) stores (docs/protocol.md §11
#21). :func:`announce_store` turns a store of this SDK into ``stored``
:class:`~lmcache_kv_fast.protocol.types.KVEventRecord` objects whose block hashes are
computed exactly like the server's (blake3 chain, :mod:`lmcache_kv_fast.hashing`) and hands
them to the in-process listeners registered with :func:`add_listener`. Importing this module
registers a store hook (:mod:`lmcache_kv_fast.client.store_hooks`) that announces a store
when somebody listens for its model, so nothing is hashed otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_kv_fast.client.store_hooks import add_store_hook
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from lmcache_kv_fast.events.common import KIND_STORED, LOCAL_SEQ, MEDIUM_CPU, PROBE_TIMEOUT_S
from lmcache_kv_fast.hashing import HASH_ALGORITHM, blake3_available, chunk_hashes, require_blake3
from lmcache_kv_fast.protocol.types import KVEventRecord
from lmcache_kv_fast.transport.http import HttpInfoClient

logger = logging.getLogger("lmcache_kv_fast.events")


@dataclass(frozen=True)
class StoreAnnouncement:
    """One SDK store, as its listeners see it.

    Attributes:
        model_name: Model the chunks were stored under.
        url: ZMQ URL of the server that holds them.
        cache_salt: The store's salt (not part of the hashes; a separate key field).
        chunk_size: Tokens per chunk.
        records: One ``stored`` record per chunk (``seq`` = :data:`LOCAL_SEQ`).
    """

    model_name: str
    url: str
    cache_salt: str
    chunk_size: int
    records: tuple[KVEventRecord, ...]


Listener = Callable[[StoreAnnouncement], None]

_listeners_lock = threading.Lock()
_listeners: dict[str, tuple[Listener, ...]] = {}
_hash_algorithms: dict[str, str] = {}
_warned_no_blake3 = False


def _model_of(target: Any) -> str:
    model = target if isinstance(target, str) else getattr(target, "model_name", None)
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError(
            f"expected a context, an endpoint or a model name, got {type(target).__name__}"
        )
    return model


def server_hash_algorithm(target: Any) -> str:
    """Return the server's ``--hash-algorithm`` (``/config`` ``mp.hash_algorithm``), cached.

    Raises:
        KVCacheSDKError: ``/config`` cannot be read.
    """
    ha = getattr(target, "hash_algorithm", None)
    if isinstance(ha, str):
        return ha
    http_url = target.http_url
    with _listeners_lock:
        cached = _hash_algorithms.get(http_url)
    if cached is not None:
        return cached
    mp = HttpInfoClient(http_url, PROBE_TIMEOUT_S, getattr(target, "api_key", None)
                        ).config()["mp"]
    ha = str(mp.get("hash_algorithm", HASH_ALGORITHM))
    with _listeners_lock:
        _hash_algorithms[http_url] = ha
    return ha


def add_listener(target: Any, fn: Listener, *, check_hash_algorithm: bool = True
                 ) -> Callable[[], None]:
    """Call ``fn(announcement)`` after every store of this SDK for the target's model.

    Listeners run synchronously on the storing thread, right after the store; they must be
    quick and must not raise (exceptions are logged and swallowed).

    Args:
        target: A context or endpoint (its ``model_name``), or a model name.
        fn: Called with a :class:`StoreAnnouncement`.
        check_hash_algorithm: With a context/endpoint, verify that the server hashes with
            blake3 (else the announced hashes would not be the server's).

    Returns:
        A function that removes the listener.

    Raises:
        KVCacheSDKError: ``blake3`` is not installed, or the server uses another hash
            algorithm.
    """
    if not callable(fn):
        raise InvalidTypeError(f"fn must be callable, got {type(fn).__name__}")
    model = _model_of(target)
    require_blake3()
    if check_hash_algorithm and not isinstance(target, str):
        ha = server_hash_algorithm(target)
        if ha != HASH_ALGORITHM:
            raise KVCacheSDKError(
                f"the server at {getattr(target, 'http_url', '?')} hashes chunks with {ha!r}; "
                f"SDK store announcements reproduce only {HASH_ALGORITHM!r}"
            )
    with _listeners_lock:
        _listeners[model] = (*_listeners.get(model, ()), fn)
    return lambda: remove_listener(model, fn)


def remove_listener(target: Any, fn: Listener) -> bool:
    """Remove a listener added with :func:`add_listener`; True if it was registered."""
    model = _model_of(target)
    with _listeners_lock:
        fns = _listeners.get(model, ())
        if fn not in fns:
            return False
        rest = tuple(f for f in fns if f is not fn)
        if rest:
            _listeners[model] = rest
        else:
            _listeners.pop(model, None)
    return True


def has_listeners(model_name: str) -> bool:
    """Whether any listener wants announcements for ``model_name`` (cheap; no hashing)."""
    return model_name in _listeners


def announce_store(ctx: Any, tokens: Sequence[int] | Any, cache_salt: str = "",
                   chunks_stored: int | None = None) -> list[KVEventRecord]:
    """Announce a store of this SDK to the listeners of ``ctx.model_name``.

    The context calls this after a successful store. Without listeners it returns at once
    (nothing is hashed); it never raises.

    Args:
        ctx: The storing context (``model_name``, ``chunk_size``, ``url``).
        tokens: The stored token ids from position 0.
        cache_salt: The store's salt.
        chunks_stored: Leading whole chunks now in the cache (None: all whole chunks).

    Returns:
        The ``stored`` records delivered (one per chunk, parent chain, chunk token ids),
        or ``[]`` when nobody listens or nothing whole was stored.
    """
    global _warned_no_blake3
    try:
        model = ctx.model_name
        with _listeners_lock:
            fns = _listeners.get(model, ())
        if not fns:
            return []
        if not blake3_available():
            if not _warned_no_blake3:
                _warned_no_blake3 = True
                logger.warning("store announcements skipped: pip install blake3")
            return []
        c = int(ctx.chunk_size)
        toks = tokens.tolist() if hasattr(tokens, "tolist") else tokens
        hashes = chunk_hashes(toks, c, max_chunks=chunks_stored)
        records = tuple(
            KVEventRecord(
                seq=LOCAL_SEQ, kind=KIND_STORED, medium=MEDIUM_CPU, model_name=model,
                block_hashes=[h], parent_block_hash=hashes[i - 1] if i else None,
                token_ids=list(toks[i * c:(i + 1) * c]),
            )
            for i, h in enumerate(hashes)
        )
    except Exception:  # announcing must never break a store
        logger.exception("could not compute the store announcement")
        return []
    if not records:
        return []
    ann = StoreAnnouncement(model, str(getattr(ctx, "url", "")), cache_salt, c, records)
    for fn in fns:
        try:
            fn(ann)
        except Exception:  # a broken listener must not break a store
            logger.exception("KV event listener %r failed", fn)
    return list(records)


def _announce_if_listening(ctx: Any, tokens: Sequence[int], cache_salt: str, chunks: int) -> None:
    """The store hook: announce the store when somebody listens for its model."""
    if has_listeners(ctx.model_name):
        announce_store(ctx, tokens, cache_salt, chunks)


add_store_hook(_announce_if_listening)
