"""The one place the sdk package calls the project's pipelined rewrite engine.

``run_rewrite_items`` runs ``fetch -> fn -> store`` over items with at most
``max_in_flight`` alive and reports each item in input order. It uses
``lmcache_kv_fast.rewrite_engine.RewriteEngine`` (the engine under ``batch.rewrite``)
when the installed package has it; until then an equivalent bounded pipeline over the
context's public calls (the same flow ``batch.rewrite`` runs per item) is used.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_kv_fast.context import LMCacheKVCacheContext
from lmcache_kv_fast.results import StoreResult

logger = logging.getLogger(__name__)

__all__ = ["OnResult", "run_rewrite_items"]

#: ``on_result(index, status, stage, reason, stages)`` per item, in input order.
OnResult = Callable[[int, str, str, str, dict[str, float]], None]
FetchFn = Callable[[LMCacheKVCacheContext, Any], "tuple[torch.Tensor | None, Sequence[int]]"]
EditFn = Callable[[torch.Tensor, Sequence[int]], "tuple[torch.Tensor, Sequence[int]]"]
StoreFn = Callable[[torch.Tensor, Sequence[int], str], StoreResult]


def _engine_class() -> Any:
    try:
        from lmcache_kv_fast.rewrite_engine import RewriteEngine
    except ImportError:
        return None
    return RewriteEngine


def run_rewrite_items(ctx: LMCacheKVCacheContext, items: Sequence[Any], fn: EditFn,
                      cache_salt: str, *, fetch: FetchFn, on_result: OnResult,
                      max_in_flight: int, progress: bool, store: StoreFn | None = None) -> int:
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
        store: ``store(kv, tokens, cache_salt) -> StoreResult`` instead of
            ``ctx.store_ex`` (the sdk stores a CPU engine's edit as rows, ``kvio.py``).
    """
    store_fn: StoreFn = store if store is not None else ctx.store_ex
    engine_cls = _engine_class()
    if engine_cls is not None:
        extra = {"store": store} if store is not None and _accepts(engine_cls, "store") else {}
        engine = engine_cls(ctx, fn, cache_salt, max_in_flight=max_in_flight, fetch=fetch,
                            progress=progress, desc="modify", reuse_buffers=False, **extra)
        report = engine.run(items, on_result=lambda r: on_result(
            r.index, r.status, r.stage, r.reason, dict(r.stages)), total=len(items))
        return int(report.peak_in_flight)
    return _pipelined(ctx, items, fn, cache_salt, fetch, store_fn, on_result, max_in_flight,
                      progress)


def _accepts(cls: Any, name: str) -> bool:
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def _pipelined(ctx: LMCacheKVCacheContext, items: Sequence[Any], fn: EditFn, salt: str,
               fetch: FetchFn, store: StoreFn, on_result: OnResult, max_in_flight: int,
               progress: bool) -> int:
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
            r = store(new_kv, new_toks, salt)
        except Exception as err:
            return "failed", "store", f"{type(err).__name__}: {err}", stages
        stages["store"] = time.perf_counter() - t
        if not r.ok:
            return "failed", "store", (
                f"store incomplete: {r.chunks_written} written, {r.chunks_already_cached} "
                f"already cached, {r.chunks_refused} refused of {r.chunks_total} chunks"
                if r.chunks_total else "fewer tokens than one chunk"), stages
        return "ok", "", "", stages

    # one thread per stream in flight: each runs its stream's read -> fn -> store, so the
    # server's replies to one stream's requests overlap the other streams' work
    workers = max(1, max_in_flight)
    pending: dict[cf.Future[Any], int] = {}
    finished: dict[int, tuple[str, str, str, dict[str, float]]] = {}
    peak = reported = 0
    bar = Progress(len(items), "modify", progress)
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmcache-sdk-modify")
    try:
        it = iter(enumerate(items))
        exhausted = False
        while True:
            # refill as soon as any stream is done (not only the oldest): a slow stream
            # does not hold the others back; results are still reported in input order
            while not exhausted and len(pending) < max_in_flight:
                nxt = next(it, None)
                if nxt is None:
                    exhausted = True
                    break
                pending[pool.submit(task, nxt[1])] = nxt[0]
                peak = max(peak, len(pending))
            if not pending:
                break
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                finished[pending.pop(fut)] = fut.result()
            while reported in finished:
                on_result(reported, *finished.pop(reported))
                reported += 1
                bar.update()
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return peak
