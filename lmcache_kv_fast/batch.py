"""High-throughput batch KV rewriting: pipelined ``retrieve_many`` / ``store_many`` / ``rewrite``.

Every item runs the ordinary context flows; a small pool of worker threads (each with its
own DEALER socket, so several requests are in flight on the connection at once) overlaps
the RPC round trips of some sequences with the copies and the user's ``fn`` of others
(``rewrite`` uses one worker on machines of <= 3 cores, where each sequence's copies and
edit already use every core). At most ``max_in_flight`` items are alive at any time, so
memory stays bounded by ``max_in_flight × largest KV`` whatever the batch length;
retrieved KV is read into a pool of reused buffers, and an ``fn`` that accepts ``alloc``
gets reused, pre-faulted output buffers too (no page faults on fresh memory, which
otherwise cost more than a cheap edit).

Errors of one item (miss, refused store, ``fn`` raising) are recorded in the
:class:`BatchReport` with the item's index and reason; the batch goes on. A
``KeyboardInterrupt`` or a closed context stops the batch after the in-flight items have
finished their server calls, so nothing is left on the server (sessions, locks, slots).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_kv_fast.context import LMCacheKVCacheContext, normalize_tokens, usable_cores
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError

logger = logging.getLogger(__name__)

ModifyFn = Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, Sequence[int]]]
DEFAULT_MAX_IN_FLIGHT = 3


@dataclass
class ItemError:
    """One failed or missed item of a batch."""

    index: int
    stage: str
    reason: str


@dataclass
class BatchReport:
    """What a batch did.

    Attributes:
        items: Items processed.
        ok: Items fully done (retrieved / stored / rewritten).
        missed: Items with nothing cached to retrieve.
        failed: Items that failed (refused store, ``fn`` raised, server error).
        cancelled: Items not started because the batch was interrupted.
        tokens_moved: Tokens retrieved plus tokens stored.
        bytes_moved: KV bytes retrieved plus stored.
        seconds: Wall time of the batch.
        stage_seconds: Summed per-stage time over items: ``retrieve``, ``fn``, ``store``
            (each includes its RPCs and copies; ``copy`` is the copy share of both).
        errors: One :class:`ItemError` per missed/failed item.
        peak_in_flight: Most items alive at once.
    """

    items: int = 0
    ok: int = 0
    missed: int = 0
    failed: int = 0
    cancelled: int = 0
    tokens_moved: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    errors: list[ItemError] = field(default_factory=list)
    peak_in_flight: int = 0

    @property
    def gbps(self) -> float:
        """KV gigabytes per second moved over the batch."""
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One human-readable paragraph."""
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(self.stage_seconds.items()))
        return (
            f"{self.items} items: {self.ok} ok, {self.missed} missed, {self.failed} failed"
            f"{f', {self.cancelled} cancelled' if self.cancelled else ''}; "
            f"{self.tokens_moved} tokens, {self.bytes_moved / 2**20:.1f} MiB in "
            f"{self.seconds:.2f}s ({self.gbps:.2f} GB/s); stages: {stages}; "
            f"peak in flight {self.peak_in_flight}"
        )

    def _add(self, other: _ItemResult) -> None:
        self.items += 1
        self.tokens_moved += other.tokens
        self.bytes_moved += other.nbytes
        for k, v in other.stages.items():
            self.stage_seconds[k] += v
        if other.status == "ok":
            self.ok += 1
        else:
            if other.status == "missed":
                self.missed += 1
            else:
                self.failed += 1
            self.errors.append(ItemError(other.index, other.stage, other.reason))


@dataclass
class _ItemResult:
    index: int
    status: str = "ok"  # ok | missed | failed
    stage: str = ""
    reason: str = ""
    tokens: int = 0
    nbytes: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    value: Any = None


class BufferPool:
    """A bounded pool of reusable, pre-touched KV buffers of one shape.

    ``retrieve_many(..., out_pool=BufferPool(ctx, max_tokens, n))`` reads each sequence into a
    pooled buffer; the yielded tensor is a view of it, valid until the iterator advances.

    Args:
        ctx: The context (gives shape and dtype).
        max_tokens: Largest sequence the buffers must hold.
        size: Number of buffers (at least the batch's ``max_in_flight``).
    """

    def __init__(self, ctx: LMCacheKVCacheContext, max_tokens: int, size: int) -> None:
        if not isinstance(ctx, LMCacheKVCacheContext):
            raise InvalidTypeError(
                f"BufferPool: ctx must be an LMCacheKVCacheContext, got {type(ctx).__name__}"
            )
        ctx._check_process()
        for name, v in (("max_tokens", max_tokens), ("size", size)):
            if type(v) is not int:
                raise InvalidTypeError(
                    f"BufferPool: {name} must be an int, got {type(v).__name__} {v!r:.40}"
                )
            if v < 1:
                raise InvalidArgumentError(f"BufferPool: {name} must be >= 1, got {v}")
        self.shape = ctx.kv_shape(max_tokens)
        self._free: collections.deque[torch.Tensor] = collections.deque()
        for _ in range(size):
            t = torch.empty(self.shape, dtype=ctx.dtype)
            t.view(-1).view(torch.uint8)[:: 4096].zero_()  # fault the pages in once
            self._free.append(t)
        self._cv = threading.Condition()
        self.size = size

    def acquire(self) -> torch.Tensor:
        """Take a buffer (blocks until one is free)."""
        with self._cv:
            self._cv.wait_for(lambda: bool(self._free))
            return self._free.popleft()

    def release(self, t: torch.Tensor) -> None:
        """Give a buffer back."""
        with self._cv:
            self._free.append(t)
            self._cv.notify()


class OutputPool:
    """Reused, pre-faulted output memory for ``fn`` (``rewrite(..., fn)`` with ``alloc``).

    A fresh large tensor costs a page fault per 4 KiB the first time it is written (often
    more than the edit itself: ~50 ms of a 75 ms token drop over 256 MiB here). The pool
    hands out views of byte buffers it keeps warm; every buffer an item took comes back
    once that item's store has finished. At most ``keep`` idle buffers are kept.

    Args:
        keep: Idle buffers kept for reuse (others are freed).
    """

    def __init__(self, keep: int) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._keep = max(1, keep)
        self.allocated = 0  # buffers created (pool misses)

    def alloc(self, shape: Sequence[int], dtype: torch.dtype, taken: list[torch.Tensor]
              ) -> torch.Tensor:
        """A contiguous tensor of ``shape``/``dtype`` (content undefined), recorded in ``taken``."""
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(f"alloc: negative dimension in shape {shape}")
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"alloc: dtype must be a torch.dtype, got {dtype!r}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = None
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._free.remove(buf)
        if buf is None:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            buf[::4096].zero_()  # fault the pages in once; later items reuse them warm
            self.allocated += 1
        taken.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def give_back(self, taken: list[torch.Tensor]) -> None:
        """Return an item's buffers (after its store read them)."""
        with self._lock:
            for b in taken:
                self._free.append(b)
            self._free.sort(key=lambda b: -b.numel())
            del self._free[self._keep:]
        taken.clear()


def _accepts_alloc(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes an ``alloc`` keyword argument."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("alloc")
    return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _check_common(ctx: Any, max_in_flight: int) -> None:
    if not isinstance(ctx, LMCacheKVCacheContext):
        raise InvalidArgumentError(f"ctx must be an LMCacheKVCacheContext, got {type(ctx).__name__}")
    ctx._check_process()
    if type(max_in_flight) is not int or max_in_flight < 1:
        raise InvalidArgumentError(f"max_in_flight must be a positive int, got {max_in_flight!r}")


class _Progress:
    """tqdm when installed, else a log line every ~5 s."""

    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        self._bar = None
        self._n = 0
        self._total = total
        self._desc = desc
        self._last = time.monotonic()
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="seq", leave=False)
            except ImportError:
                self._bar = None

    def update(self) -> None:
        self._n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        elif time.monotonic() - self._last > 5.0:
            self._last = time.monotonic()
            logger.info("%s: %d/%s sequences", self._desc, self._n, self._total or "?")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _run_pipelined(
    work: Iterable[tuple[int, Any]],
    task: Callable[[int, Any], _ItemResult],
    *,
    workers: int,
    max_in_flight: int,
    report: BatchReport,
    progress: _Progress,
    should_stop: Callable[[], bool] = lambda: False,
) -> Iterator[_ItemResult]:
    """Run ``task`` over ``work`` on ``workers`` threads, ≤ ``max_in_flight`` alive, in order."""
    window: collections.deque[cf.Future[_ItemResult]] = collections.deque()
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
        # Stop feeding; let in-flight items finish their server calls (no leftovers).
        for f in window:
            f.cancel()
        done = [f for f in window if not f.cancelled()]
        for f in done:
            try:
                report._add(f.result())
            except BaseException as err:
                logger.warning("in-flight item failed during cancellation: %r", err)
        report.cancelled += sum(1 for f in window if f.cancelled())
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        report.seconds = time.perf_counter() - t0
        progress.close()


def _fail(res: _ItemResult, stage: str, err: BaseException) -> _ItemResult:
    res.status, res.stage, res.reason = "failed", stage, f"{type(err).__name__}: {err}"
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
    _check_common(ctx, max_in_flight)
    if out_pool is not None and out_pool.size < max_in_flight + 1:
        max_in_flight = max(1, out_pool.size - 1)
    rep = report if report is not None else BatchReport()

    def task(index: int, toks: Sequence[int]) -> _ItemResult:
        res = _ItemResult(index)
        buf = out_pool.acquire() if out_pool is not None else None
        t = time.perf_counter()
        try:
            kv = ctx.retrieve(toks, cache_salt, out=buf)
        except Exception as err:
            if buf is not None:
                out_pool.release(buf)  # type: ignore[union-attr]
            return _fail(res, "retrieve", err)
        res.stages["retrieve"] = time.perf_counter() - t
        if kv is None:
            if buf is not None:
                out_pool.release(buf)  # type: ignore[union-attr]
            res.status, res.stage, res.reason = "missed", "retrieve", "nothing cached"
        else:
            res.tokens, res.nbytes = kv.shape[-2], _nbytes(kv)
        res.value = (kv, buf)
        return res

    progress_bar = _Progress(_len(token_lists), "retrieve_many", progress)
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
    _check_common(ctx, max_in_flight)
    rep = BatchReport()

    def task(index: int, item: tuple[torch.Tensor, Sequence[int]]) -> _ItemResult:
        res = _ItemResult(index)
        try:
            kv, toks = item
        except (TypeError, ValueError) as err:
            return _fail(res, "store", err)
        t = time.perf_counter()
        try:
            r = ctx.store_ex(kv, toks, cache_salt)
        except Exception as err:
            return _fail(res, "store", err)
        res.stages["store"] = time.perf_counter() - t
        _account_store(res, kv, r)
        return res

    for _ in _run_pipelined(enumerate(items), task, workers=workers or min(max_in_flight, 4),
                            max_in_flight=max_in_flight, report=rep,
                            progress=_Progress(_len(items), "store_many", progress),
                            should_stop=lambda: ctx.closed):
        pass
    return rep


def _len(x: Any) -> int | None:
    try:
        return len(x)
    except TypeError:
        return None


def _account_store(res: _ItemResult, kv: torch.Tensor, r: Any) -> None:
    if r.ok:
        res.tokens += r.tokens_stored
        per_token = _nbytes(kv) // max(1, kv.shape[-2])
        res.nbytes += per_token * r.chunks_written * (r.tokens_stored // max(1, r.chunks_total))
    else:
        res.status, res.stage = "failed", "store"
        res.reason = (f"store incomplete: {r.chunks_written} written, "
                      f"{r.chunks_already_cached} already cached, {r.chunks_refused} refused "
                      f"of {r.chunks_total} chunks" if r.chunks_total else
                      "fewer tokens than one chunk")


def rewrite(
    ctx: LMCacheKVCacheContext,
    token_lists: Iterable[Sequence[int]],
    fn: ModifyFn,
    cache_salt: str = "",
    *,
    workers: int | None = None,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    progress: bool = True,
    reuse_buffers: bool = True,
) -> BatchReport:
    """Rewrite many sequences: retrieve, apply ``fn``, store the edit — pipelined.

    Each sequence is retrieved, ``fn(kv, tokens) -> (new_kv, new_tokens)`` is applied and the
    result is stored under ``new_tokens``.

    ``fn`` gets the retrieved KV (``[2, L, hit, D]``) and the hit's tokens; it must not keep
    a reference to ``kv`` (or to what it returns) after returning when ``reuse_buffers`` is
    True: the buffers are reused for a later sequence once this one is stored. ``fn`` may
    return a view of ``kv`` (e.g. an in-place edit narrowed to the kept tokens).

    When ``fn`` accepts an ``alloc`` keyword, it is called as
    ``fn(kv, tokens, alloc=alloc)`` where ``alloc(shape, dtype)`` returns a contiguous
    tensor from a pool of reused, pre-faulted buffers (given back after the sequence is
    stored). Writing the edit into such a tensor (``torch.index_select(..., out=...)``,
    ``out.copy_(...)``) avoids a page fault per 4 KiB of fresh output, which otherwise
    dominates a cheap edit of a large KV.

    Args:
        ctx: Connected context.
        token_lists: Sequences to rewrite.
        fn: The edit (the shape of upstream's ``ModifyFnType`` for one KV tensor).
        cache_salt: Salt for reads and writes.
        workers: Worker threads (default ``min(max_in_flight, 3, cores // 2)``, at least 1:
            on a small machine the copies and the edit already use every core).
        max_in_flight: Sequences alive at once (memory bound).
        progress: Show a progress bar (tqdm if installed, else log lines).
        reuse_buffers: Read into a pool of reused buffers sized by the first sequences.

    Returns:
        The :class:`BatchReport`.
    """
    _check_common(ctx, max_in_flight)
    if not callable(fn):
        raise InvalidArgumentError(f"fn must be callable, got {type(fn).__name__}")
    rep = BatchReport()
    free: collections.deque[torch.Tensor] = collections.deque()
    free_lock = threading.Lock()
    out_pool = OutputPool(max_in_flight + 1) if _accepts_alloc(fn) else None

    def take(tokens: int) -> torch.Tensor | None:
        if not reuse_buffers:
            return None
        with free_lock:
            for _ in range(len(free)):
                t = free.popleft()
                if t.shape[-2] >= tokens:
                    return t
                free.append(t)
        return torch.empty(ctx.kv_shape(tokens), dtype=ctx.dtype)

    def give(t: torch.Tensor | None) -> None:
        if t is not None:
            with free_lock:
                if len(free) < max_in_flight:
                    free.append(t)

    def task(index: int, toks_in: Sequence[int]) -> _ItemResult:
        res = _ItemResult(index)
        try:
            toks = normalize_tokens(toks_in)
        except KVCacheSDKError as err:
            return _fail(res, "retrieve", err)
        whole = len(toks) // ctx.chunk_size * ctx.chunk_size
        buf = take(whole) if whole else None
        taken: list[torch.Tensor] = []
        try:
            t = time.perf_counter()
            try:
                kv = ctx.retrieve(toks, cache_salt, out=buf)
            except Exception as err:
                return _fail(res, "retrieve", err)
            res.stages["retrieve"] = time.perf_counter() - t
            if kv is None:
                res.status, res.stage, res.reason = "missed", "retrieve", "nothing cached"
                return res
            hit = kv.shape[-2]
            res.tokens, res.nbytes = hit, _nbytes(kv)
            t = time.perf_counter()
            try:
                if out_pool is not None:
                    new_kv, new_toks = fn(kv, toks[:hit], alloc=lambda shape, dtype=ctx.dtype:
                                          out_pool.alloc(shape, dtype, taken))
                else:
                    new_kv, new_toks = fn(kv, toks[:hit])
            except Exception as err:
                return _fail(res, "fn", err)
            res.stages["fn"] = time.perf_counter() - t
            t = time.perf_counter()
            try:
                r = ctx.store_ex(new_kv, new_toks, cache_salt)
            except Exception as err:
                return _fail(res, "store", err)
            res.stages["store"] = time.perf_counter() - t
            _account_store(res, new_kv, r)
            return res
        finally:
            give(buf)
            if out_pool is not None:
                out_pool.give_back(taken)

    toks_list = token_lists if isinstance(token_lists, Sequence) else list(token_lists)
    if workers is None:
        # Each sequence's copies already use every core (native pool) and so does a torch
        # edit: a second sequence in flight on <= 3 cores only contends for cores and
        # memory bandwidth (measured: 1 worker 1.22-1.30 s, 2 workers 1.41-1.64 s, 3 workers
        # 1.95-1.99 s for W3 on 2 cores). More cores overlap sequences.
        workers = max(1, min(max_in_flight, 3, usable_cores() // 2))
    elif type(workers) is not int or workers < 1:
        raise InvalidArgumentError(f"workers must be a positive int, got {workers!r}")
    for _ in _run_pipelined(enumerate(toks_list), task, workers=workers,
                            max_in_flight=max_in_flight, report=rep,
                            progress=_Progress(len(toks_list), "rewrite", progress),
                            should_stop=lambda: ctx.closed):
        pass
    logger.info("rewrite: %s", rep.summary())
    return rep
