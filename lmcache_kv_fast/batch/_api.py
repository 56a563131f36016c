"""The batch functions: ``retrieve_many``, ``store_many`` (per-item tasks on a pool) and ``rewrite``."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lmcache_kv_fast.batch._engine import REWRITE_DEFAULT_MAX_IN_FLIGHT, RewriteEngine
from lmcache_kv_fast.batch._pools import BufferPool
from lmcache_kv_fast.batch._report import (
    BatchReport,
    ItemResult,
    check_common,
    length_of,
    nbytes,
)
from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.progress import Progress

logger = logging.getLogger(__name__)

ModifyFn = Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, Sequence[int]]]
DEFAULT_MAX_IN_FLIGHT = 3
#: rewrite's default: a sequence being stored, one being edited and one being retrieved
#: need two alive (a retrieve starts when a store ends); a third costs memory and buys
#: no speed (docs/performance.md).
REWRITE_MAX_IN_FLIGHT = REWRITE_DEFAULT_MAX_IN_FLIGHT


def release_buffers() -> int:
    """Unmap the idle warm buffers the native core keeps for reuse; return their bytes.

    Retrieve results and ``rewrite``'s buffers and pooled edit outputs go back to a
    process-wide pool when their last tensor dies, so the next retrieve or batch finds
    them faulted in. The pool keeps at most ``LMCACHE_KV_FAST_RESULT_POOL_MB`` (default
    min(4 GiB, RAM / 8)) of idle buffers; this gives them all back to the OS now (a no-op
    with the torch backend).
    """
    from lmcache_kv_fast.copy.select import backend

    return backend().release_results()


def _run_pipelined(
    work: Iterable[tuple[int, Any]],
    task: Callable[[int, Any], ItemResult],
    *,
    workers: int,
    max_in_flight: int,
    report: BatchReport,
    progress: Progress,
    should_stop: Callable[[], bool] = lambda: False,
) -> Iterator[ItemResult]:
    """Run ``task`` over ``work`` on ``workers`` threads, ≤ ``max_in_flight`` alive, in order."""
    window: collections.deque[cf.Future[ItemResult]] = collections.deque()
    it = iter(work)
    exhausted = False
    t0 = time.perf_counter()
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmcache-kv-batch")
    try:
        while True:
            while not exhausted and len(window) < max_in_flight:
                if should_stop():  # e.g. the context was closed: stop feeding
                    exhausted = True
                    report.cancelled += sum(1 for _ in it)
                    break
                try:
                    index, item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                window.append(pool.submit(task, index, item))
                report.peak_in_flight = max(report.peak_in_flight, len(window))
            if not window:
                break
            res = window.popleft().result()
            report._add(res)
            progress.update()
            yield res
    except BaseException:
        _cancel_window(window, report)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        report.seconds = time.perf_counter() - t0
        progress.close()


def _cancel_window(window: collections.deque[cf.Future[ItemResult]], report: BatchReport) -> None:
    """Stop feeding; let in-flight items finish their server calls (no leftovers)."""
    for f in window:
        f.cancel()
    done = [f for f in window if not f.cancelled()]
    for f in done:
        try:
            report._add(f.result())
        except BaseException as err:
            logger.warning("in-flight item failed during cancellation: %r", err)
    report.cancelled += sum(1 for f in window if f.cancelled())


def _retrieve_one(ctx: LMCacheKVCacheContext, cache_salt: str, out_pool: BufferPool | None,
                  index: int, toks: Sequence[int]) -> ItemResult:
    """``retrieve_many``'s task: one retrieve; ``value`` is ``(kv, pooled buffer)``."""
    res = ItemResult(index)
    buf = out_pool.acquire() if out_pool is not None else None
    t = time.perf_counter()
    try:
        kv = ctx.retrieve(toks, cache_salt, out=buf)
    except Exception as err:
        if buf is not None:
            out_pool.release(buf)  # type: ignore[union-attr]
        return res.fail("retrieve", err)
    res.stages["retrieve"] = time.perf_counter() - t
    if kv is None:
        if buf is not None:
            out_pool.release(buf)  # type: ignore[union-attr]
        res.status, res.stage, res.reason = "missed", "retrieve", "nothing cached"
    else:
        res.tokens, res.nbytes = kv.shape[-2], nbytes(kv)
    res.value = (kv, buf)
    return res


def retrieve_many(
    ctx: LMCacheKVCacheContext,
    token_lists: Iterable[Sequence[int]],
    cache_salt: str = "",
    *,
    out_pool: BufferPool | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    workers: int | None = None,
    report: BatchReport | None = None,
    progress: bool = False,
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """Retrieve many sequences, pipelined; yield ``(index, kv | None)`` in input order.

    Args:
        ctx: Connected context.
        token_lists: Token sequences (any iterable; consumed lazily).
        cache_salt: Salt for every item.
        out_pool: Reuse these buffers; each yielded tensor is then valid until the iterator
            advances (copy it to keep it).
        max_in_flight: Items alive at once (memory bound).
        workers: Worker threads (default ``min(max_in_flight, 4)``).
        report: Filled in as the batch goes (misses and errors land here).
        progress: Show a progress bar (tqdm if installed, else log lines).

    Yields:
        ``(index, kv)``; ``kv`` is None for a miss or a failed item (see ``report``).
    """
    check_common(ctx, max_in_flight)
    if out_pool is not None and out_pool.size < max_in_flight + 1:
        max_in_flight = max(1, out_pool.size - 1)
    rep = report if report is not None else BatchReport()
    task = functools.partial(_retrieve_one, ctx, cache_salt, out_pool)
    progress_bar = Progress(length_of(token_lists), "retrieve_many", progress)
    for res in _run_pipelined(enumerate(token_lists), task, workers=workers or min(max_in_flight, 4),
                              max_in_flight=max_in_flight, report=rep, progress=progress_bar,
                              should_stop=lambda: ctx.closed):
        kv, buf = res.value if res.value is not None else (None, None)
        try:
            yield res.index, kv
        finally:
            if buf is not None and kv is not None:
                out_pool.release(buf)  # type: ignore[union-attr]


def store_many(
    ctx: LMCacheKVCacheContext,
    items: Iterable[tuple[torch.Tensor, Sequence[int]]],
    cache_salt: str = "",
    *,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    workers: int | None = None,
    progress: bool = False,
) -> BatchReport:
    """Store many ``(kv, tokens)`` pairs, pipelined.

    Returns:
        The :class:`BatchReport`; an item whose chunks were not all cached afterwards is
        "failed" with the chunk counts as the reason.
    """
    check_common(ctx, max_in_flight)
    rep = BatchReport()

    def task(index: int, item: tuple[torch.Tensor, Sequence[int]]) -> ItemResult:
        res = ItemResult(index)
        try:
            kv, toks = item
        except (TypeError, ValueError) as err:
            return res.fail("store", err)
        t = time.perf_counter()
        try:
            r = ctx.store_ex(kv, toks, cache_salt)
        except Exception as err:
            return res.fail("store", err)
        res.stages["store"] = time.perf_counter() - t
        res.add_store(kv, r)
        return res

    for _ in _run_pipelined(enumerate(items), task, workers=workers or min(max_in_flight, 4),
                            max_in_flight=max_in_flight, report=rep,
                            progress=Progress(length_of(items), "store_many", progress),
                            should_stop=lambda: ctx.closed):
        pass
    return rep


def rewrite(
    ctx: LMCacheKVCacheContext,
    token_lists: Iterable[Sequence[int]],
    fn: ModifyFn,
    cache_salt: str = "",
    *,
    workers: int | None = None,
    max_in_flight: int = REWRITE_MAX_IN_FLIGHT,
    progress: bool = True,
    reuse_buffers: bool = True,
    pool_outputs: bool | None = None,
    edit_threads: int | None = None,
) -> BatchReport:
    """Rewrite many sequences: retrieve, apply ``fn``, store the edit — pipelined.

    ``fn(kv, tokens) -> (new_kv, new_tokens)`` edits each retrieved hit, stored under
    ``new_tokens``; the edit of one sequence (on its own thread, under the caller's grad /
    inference mode, large op outputs from the warm result pool) overlaps the store of the
    previous and the retrieve of the next. What ``fn`` may keep, ``alloc``: docs/batch.md.

    Args:
        ctx: Connected context.
        token_lists: Sequences to rewrite.
        fn: The edit (upstream's ``ModifyFnType`` for one KV tensor); it must not keep
            ``kv`` when ``reuse_buffers``; it may take an ``alloc`` keyword.
        cache_salt: Salt for reads and writes.
        workers: I/O threads for retrieves and stores (default ``min(max_in_flight, 2)``).
        max_in_flight: Sequences alive at once (memory bound; default 2).
        progress: Show a progress bar (tqdm if installed, else log lines).
        reuse_buffers: Read into a few reused buffers (from the warm result pool).
        pool_outputs: Large op outputs of ``fn`` from the warm pool (None:
            ``LMCACHE_KV_FAST_POOL_OUTPUTS``, else on with the native core).
        edit_threads: torch intra-op threads of the edit thread only (None:
            ``LMCACHE_KV_FAST_EDIT_THREADS``, else the caller's, at most the usable cores).

    Returns:
        The :class:`BatchReport`.

    Raises:
        InvalidArgumentError: A bad argument or environment value.
        ServerUnavailableError: The server was found gone mid-batch; ``err.report`` is the
            report so far, ``not_attempted_indices`` the items never started.
    """
    engine = RewriteEngine(ctx, fn, cache_salt, io_workers=workers,
                           max_in_flight=max_in_flight, pool_outputs=pool_outputs,
                           edit_threads=edit_threads, reuse_buffers=reuse_buffers,
                           progress=progress, desc="rewrite")
    toks_list = token_lists if isinstance(token_lists, Sequence) else list(token_lists)
    rep = engine.run(toks_list, total=len(toks_list))
    logger.info("rewrite: %s", rep.summary())
    return rep
