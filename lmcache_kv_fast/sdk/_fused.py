"""The batched modify's fused path: a library edit's rows moved slot to slot.

When ``fn`` is a library edit planned without reading the KV
(:func:`lmcache_kv_fast.edits.plannable`: positional selections, with ``rope`` or not,
and chains of them) and a stream has only a KV context, its modify is one
``rewrite_rows`` call (``batch/_fused.py``) on the prefix the engine's store should have
left (when less of it is cached, nothing is written: the wait for the store, lookups with
back-off as the tensor path waits, then a second call); every kept row goes once from the
read-locked slots into the new sequence's reserved ones, K re-rotated on the way, a CPU
engine's rows in its own element order (no per-token tensor). Other streams, and any
other ``fn``, take wait → retrieve → ``fn`` → store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lmcache_kv_fast.batch import FusedHooks
from lmcache_kv_fast.edits import plannable
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.request import LMCacheRequestStreamError

__all__ = ["fused_hooks"]

KV = LMCacheSDKCacheKind.KV


def fused_hooks(fn: Callable[..., Any], timeout: float, poll_interval: float,
                token_bytes: int) -> FusedHooks | None:
    """The hooks running ``fn``'s streams slot to slot, or None when ``fn`` is not planned.

    Args:
        fn: The modify's edit.
        timeout: Longest wait per stream for the engine's store.
        poll_interval: Longest delay between two of its lookups.
        token_bytes: KV bytes of one token (the stream's accounting).
    """
    if not plannable(fn):
        return None

    def edit(m: Any, _engine_fn: Callable[..., Any]) -> Callable[..., Any] | None:
        return fn if set(m.stream.contexts) == {KV} else None

    def tokens(m: Any) -> Sequence[int]:
        try:
            res = m.stream.wait_cached(KV, timeout, poll_interval)
        except LMCacheRequestStreamError as err:
            if err.wait is not None:
                m.wait_s += err.wait.seconds
                m.lookups += err.wait.lookups
            raise
        m.wait_s += res.seconds
        m.lookups += res.lookups
        return m.stream.tokens[: res.hit_tokens]

    def expected(m: Any) -> Sequence[int]:
        chunk = m.stream.context(KV).chunk_size
        return m.stream.tokens[: m.stream.expected_cached_tokens() // chunk * chunk]

    def done(m: Any, rewritten: Any) -> None:
        m.cached_len = rewritten.hit_tokens
        m.new_tokens = list(rewritten.tokens)
        m.kv_nbytes = rewritten.hit_tokens * token_bytes
        m.nbytes += m.kv_nbytes
        m.path = "fused" if rewritten.fused else "tensor"

    return FusedHooks(edit, tokens, done, expected)
