"""The one place the sdk package calls the project's pipelined rewrite engine.

``run_rewrite_items`` runs ``fetch -> fn -> store`` over items with at most
``max_in_flight`` alive and reports each item in input order. It uses
``lmcache_kv_fast.rewrite_engine.RewriteEngine`` (the engine under ``batch.rewrite``)
when the installed package has it; until then an equivalent bounded pipeline over the
context's public calls (the same flow ``batch.rewrite`` runs per item) is used.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_kv_fast.context import LMCacheKVCacheContext

logger = logging.getLogger(__name__)

__all__ = ["OnResult", "run_rewrite_items"]

#: ``on_result(index, status, stage, reason, stages)`` per item, in input order.
OnResult = Callable[[int, str, str, str, dict[str, float]], None]
FetchFn = Callable[[LMCacheKVCacheContext, Any], "tuple[torch.Tensor | None, Sequence[int]]"]
EditFn = Callable[[torch.Tensor, Sequence[int]], "tuple[torch.Tensor, Sequence[int]]"]


def _engine_class() -> Any:
    try:
        from lmcache_kv_fast.rewrite_engine import RewriteEngine
    except ImportError:
        return None
    return RewriteEngine


def run_rewrite_items(ctx: LMCacheKVCacheContext, items: Sequence[Any], fn: EditFn,
                      cache_salt: str, *, fetch: FetchFn, on_result: OnResult,
                      max_in_flight: int, progress: bool) -> int:
    """Run ``fetch -> fn -> store_ex`` over ``items``; return the peak number in flight.

    Args:
        ctx: The context every item is read from and stored to.
        items: Opaque items handed to ``fetch``.
        fn: ``fn(kv, tokens) -> (new_kv, new_tokens)``.
        cache_salt: Salt of every store.
        fetch: ``fetch(ctx, item) -> (kv | None, tokens)``; raising fails the item.
        on_result: Called per item in input order.
        max_in_flight: Items between fetch and the end of their store at once.
        progress: Show a progress bar.
    """
    engine_cls = _engine_class()
    if engine_cls is not None:
        engine = engine_cls(ctx, fn, cache_salt, max_in_flight=max_in_flight, fetch=fetch,
                            progress=progress, desc="modify", reuse_buffers=False)
        report = engine.run(items, on_result=lambda r: on_result(
            r.index, r.status, r.stage, r.reason, dict(r.stages)), total=len(items))
        return int(report.peak_in_flight)
    return _pipelined(ctx, items, fn, cache_salt, fetch, on_result, max_in_flight, progress)


def _pipelined(ctx: LMCacheKVCacheContext, items: Sequence[Any], fn: EditFn, salt: str,
               fetch: FetchFn, on_result: OnResult, max_in_flight: int, progress: bool) -> int:
    """Bounded pipeline on a few threads (the fallback of :func:`run_rewrite_items`)."""
    from lmcache_kv_fast.sdk.progress import Progress

    def task(item: Any) -> tuple[str, str, str, dict[str, float]]:
        stages: dict[str, float] = {}
        t = time.perf_counter()
        try:
            kv, toks = fetch(ctx, item)
        except Exception as err:
            return "failed", "retrieve", f"{type(err).__name__}: {err}", stages
        stages["retrieve"] = time.perf_counter() - t
        if kv is None:
            return "missed", "retrieve", "nothing cached", stages
        t = time.perf_counter()
        try:
            new_kv, new_toks = fn(kv, toks)
        except Exception as err:
            return "failed", "fn", f"{type(err).__name__}: {err}", stages
        del kv
        stages["fn"] = time.perf_counter() - t
        t = time.perf_counter()
        try:
            r = ctx.store_ex(new_kv, new_toks, salt)
        except Exception as err:
            return "failed", "store", f"{type(err).__name__}: {err}", stages
        stages["store"] = time.perf_counter() - t
        if not r.ok:
            return "failed", "store", (
                f"store incomplete: {r.chunks_written} written, {r.chunks_already_cached} "
                f"already cached, {r.chunks_refused} refused of {r.chunks_total} chunks"
                if r.chunks_total else "fewer tokens than one chunk"), stages
        return "ok", "", "", stages

    workers = max(1, min(max_in_flight, 2))
    window: collections.deque[tuple[int, cf.Future[Any]]] = collections.deque()
    peak = 0
    bar = Progress(len(items), "modify", progress)
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmcache-sdk-modify")
    try:
        it = iter(enumerate(items))
        exhausted = False
        while True:
            while not exhausted and len(window) < max_in_flight:
                nxt = next(it, None)
                if nxt is None:
                    exhausted = True
                    break
                window.append((nxt[0], pool.submit(task, nxt[1])))
                peak = max(peak, len(window))
            if not window:
                break
            index, fut = window.popleft()
            status, stage, reason, stages = fut.result()
            on_result(index, status, stage, reason, stages)
            bar.update()
    finally:
        for _, f in window:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return peak
