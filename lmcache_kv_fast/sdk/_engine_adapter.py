"""The one place the sdk package calls the project's pipelined rewrite engine.

``run_rewrite_items`` runs ``fetch -> fn -> store`` over items on
:class:`lmcache_kv_fast.batch.RewriteEngine` (the engine under ``batch.rewrite``
and the fleet's rewrite items) with one I/O thread per item in flight and one edit
thread: at most ``max_in_flight`` items alive, each item reported in input order. One
I/O thread per item in flight (the engine's default is two) lets every stream's wait,
read and store round trips overlap the others' (with two, streams queue for them:
docs/performance.md#w6). A server found gone
stops it with :class:`~lmcache_kv_fast.errors.ServerUnavailableError`; the items not
attempted are then the ones never reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_kv_fast.batch import FusedHooks, RewriteEngine
from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.results import StoreResult

logger = logging.getLogger(__name__)

__all__ = ["OnResult", "run_rewrite_items"]

#: ``on_result(index, status, stage, reason, stages)`` per item, in input order.
OnResult = Callable[[int, str, str, str, dict[str, float]], None]
FetchFn = Callable[[LMCacheKVCacheContext, Any], "tuple[torch.Tensor | None, Sequence[int]]"]
EditFn = Callable[[torch.Tensor, Sequence[int]], "tuple[torch.Tensor, Sequence[int]]"]
StoreFn = Callable[[torch.Tensor, Sequence[int], str], StoreResult]


def run_rewrite_items(ctx: LMCacheKVCacheContext, items: Sequence[Any], fn: EditFn,
                      cache_salt: str, *, fetch: FetchFn, on_result: OnResult,
                      max_in_flight: int, progress: bool, store: StoreFn | None = None,
                      fused: FusedHooks | None = None) -> int:
    """Run ``fetch -> fn -> store`` over ``items``; return the peak number in flight.

    Args:
        ctx: The context every item is read from and stored to.
        items: Opaque items handed to ``fetch``.
        fn: ``fn(kv, tokens) -> (new_kv, new_tokens)``.
        cache_salt: Salt of every store.
        fetch: ``fetch(ctx, item) -> (kv | None, tokens)``; raising fails the item.
        on_result: Called per finished item in input order (not for items not attempted).
        max_in_flight: Items between fetch and the end of their store at once.
        progress: Show a progress bar.
        store: ``store(kv, tokens, cache_salt) -> StoreResult`` instead of
            ``ctx.store_ex`` (the sdk stores a CPU engine's edit as rows, ``kvio.py``).
        fused: Which items are rewritten slot to slot instead (``batch/_fused.py``).

    Raises:
        ServerUnavailableError: An item failed and the server then did not answer a
            liveness ping: the run stopped (items never reported were not attempted).
    """
    engine = RewriteEngine(ctx, fn, cache_salt, io_workers=max_in_flight,
                           max_in_flight=max_in_flight, fetch=fetch, progress=progress,
                           desc="modify", reuse_buffers=False, store=store, fused=fused)
    report = engine.run(items, on_result=lambda r: on_result(
        r.index, r.status, r.stage, r.reason, dict(r.stages)), total=len(items))
    return int(report.peak_in_flight)
