"""The pipelined rewrite engine: retrieve -> edit -> store over many items.

One engine under ``batch.rewrite``, and meant for the batched stream's modify phase and
a distributed rewrite (each worker runs it over its share):

* I/O threads (``io_workers``, each with its own DEALER socket through the context) run
  the retrieves and the stores, stores first, so a finished edit is never queued behind
  read-ahead;
* one edit thread runs the user's ``fn`` under an
  :class:`~lmcache_kv_fast.batch._policy.EditPolicy`: large op outputs come from the warm
  result pool (no page faults on fresh memory), with the caller's grad mode and its own
  torch intra-op thread count;
* at most ``max_in_flight`` items are alive (retrieved and not yet stored), whatever the
  length of the input, and results come back in input order (``on_result``).

The edit of one item overlaps the store of the previous one and the retrieve of the next.
Errors of one item are recorded and the batch goes on; ``KeyboardInterrupt`` (in ``fn``
or in the caller) or a closed context stops it after the in-flight server calls finished,
so nothing is left on the server. After an item's server error, one liveness ping
(:mod:`lmcache_kv_fast.batch._liveness`); a server found gone stops the batch at once
(``ServerUnavailableError``, items not started counted ``not_attempted``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from lmcache_kv_fast.batch._cores import CoreCensus
from lmcache_kv_fast.batch._fused import FusedHooks, FusedPath
from lmcache_kv_fast.batch._liveness import ServerWatch
from lmcache_kv_fast.batch._policy import EditPolicy, EditRunner
from lmcache_kv_fast.batch._pools import OutputPool
from lmcache_kv_fast.batch._report import (
    BatchReport,
    ItemResult,
    check_common,
    nbytes,
)
from lmcache_kv_fast.batch._workers import Item, StoreStepFn, Workers, accepts_alloc, shares_memory
from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.copy.select import backend, usable_cores
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.progress import Progress
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.validation import normalize_tokens

logger = logging.getLogger("lmcache_kv_fast.batch")

#: ``fetch(ctx, item)`` -> ``(kv | None, tokens of kv)``: what to edit for an item.
FetchFn = Callable[[LMCacheKVCacheContext, Any], "tuple[torch.Tensor | None, Sequence[int]]"]
#: ``store(kv, tokens, cache_salt)`` -> ``StoreResult``: what stores an edit (default
#: ``ctx.store_ex``; e.g. the sdk stores a CPU engine's edit as its rows).
StoreFn = Callable[[torch.Tensor, Sequence[int], str], StoreResult]
DEFAULT_IO_WORKERS = 2
REWRITE_DEFAULT_MAX_IN_FLIGHT = 2


class _BatchRun:
    """One :meth:`RewriteEngine.results` call: its window of live items and its report."""

    def __init__(self, rep: BatchReport, progress: Progress) -> None:
        self.rep, self.progress = rep, progress
        self.window: collections.deque[Item] = collections.deque()
        self.exhausted = False  # nothing more is read from the input

    def next_item(self, source: Iterator[tuple[int, Any]], closed: bool) -> Item | None:
        """The next input item, or None when the input ended or the context is closed."""
        if closed:  # stop feeding; in-flight items finish (or fail: closed)
            self.exhausted = True
            self.rep.cancelled += sum(1 for _ in source)
            return None
        nxt = next(source, None)
        if nxt is None:
            self.exhausted = True
            return None
        return Item(nxt[0], nxt[1], ItemResult(nxt[0]))

    def skip_rest(self, source: Iterator[tuple[int, Any]]) -> None:
        """Count the items not read yet as not attempted (the server is gone)."""
        self.exhausted = True
        for i, _ in source:
            self.rep.not_attempted += 1
            self.rep.not_attempted_indices.append(i)

    def collect(self, it: Item) -> ItemResult | None:
        """Wait for ``it``; account it; return it unless cancelled or not attempted."""
        res = it.done.result()
        if res.status == "cancelled":
            self.rep.cancelled += 1
            return None
        if res.status == "not_attempted":
            self.rep.not_attempted += 1
            self.rep.not_attempted_indices.append(res.index)
            return None
        self.rep._add(res)
        self.progress.update()
        return res

    def drain(self) -> None:
        """Wait for the items still in the window (the batch is stopping)."""
        for it in self.window:
            try:
                self.collect(it)
            except BaseException as err:  # already stopping: the first error is raised
                logger.debug("in-flight item ended with %r while stopping", err)


class RewriteEngine:
    """Pipelined ``fetch -> fn -> store`` over items (see the module docstring).

    Driven by :meth:`results` / :meth:`run` over an iterable (one batch, as ``rewrite``
    does), or for items arriving over time (a fleet actor's Ray calls) by :meth:`open`,
    :meth:`submit` per item (its own ``fn``, salt, store step if needed) and :meth:`close`:
    the threads, retrieve buffers and output pool then stay warm across calls.

    Args:
        ctx: Connected context.
        fn: ``fn(kv, tokens) -> (new_kv, new_tokens)``; with an ``alloc`` keyword it also
            gets pooled output buffers (see ``batch.rewrite``).
        cache_salt: Salt for reads and writes.
        io_workers: Threads for retrieves and stores (default 2, at most ``max_in_flight``).
        max_in_flight: Items alive at once (memory bound; default 2). With :meth:`submit`
            the caller bounds the items it submits; this sizes the buffer pools.
        pool_outputs: Large op outputs of ``fn`` from the warm pool (None: environment,
            then on); see :mod:`lmcache_kv_fast.batch._policy`.
        edit_threads: torch intra-op threads of the edit thread (None: environment, then
            the caller's count, at most the usable cores).
        reuse_buffers: Retrieve into a few reused buffers (else the context allocates).
        fetch: ``fetch(ctx, item) -> (kv | None, tokens)`` (e.g. wait until an engine's
            store is visible); default: the item is a token sequence, retrieved (reused buffers).
        progress: Show a progress bar.
        desc: Progress label.
        store: ``store(kv, tokens, cache_salt) -> StoreResult`` instead of ``ctx.store_ex``.
        fused: With a custom fetch / store, which items still run fused (``FusedHooks``).

    Raises:
        InvalidArgumentError: Bad arguments.
    """

    def __init__(self, ctx: LMCacheKVCacheContext, fn: Callable[..., Any], cache_salt: str = "",
                 *, io_workers: int | None = None,
                 max_in_flight: int = REWRITE_DEFAULT_MAX_IN_FLIGHT,
                 pool_outputs: bool | None = None, edit_threads: int | None = None,
                 reuse_buffers: bool = True, fetch: FetchFn | None = None,
                 progress: bool = False, desc: str = "rewrite",
                 store: StoreFn | None = None, fused: FusedHooks | None = None) -> None:
        check_common(ctx, max_in_flight)
        if not callable(fn):
            raise InvalidArgumentError(f"fn must be callable, got {type(fn).__name__}")
        if io_workers is not None and (type(io_workers) is not int or io_workers < 1):
            raise InvalidArgumentError(f"workers must be a positive int, got {io_workers!r}")
        self.ctx, self.fn, self.salt = ctx, fn, cache_salt
        self.max_in_flight = max_in_flight
        self.io_workers = io_workers or min(max_in_flight, DEFAULT_IO_WORKERS)
        be = backend()
        self._native = be.NAME == "native"
        self.policy = EditPolicy.resolve(pool_outputs, edit_threads, cores=usable_cores(),
                                         caller_threads=torch.get_num_threads(),
                                         native=self._native)
        self._alloc_result = be.alloc_result
        self.census = CoreCensus(getattr(be, "cap_call_threads", None) if self._native else None)
        self.reuse_buffers = reuse_buffers
        self._fetch_fn = fetch
        if store is not None and not callable(store):
            raise InvalidArgumentError(f"store must be callable, got {type(store).__name__}")
        self._store_fn: StoreFn = store if store is not None else ctx.store_ex
        self.progress, self.desc = progress, desc
        self._out_pool: OutputPool | None = None
        self._takes_alloc: dict[int, tuple[Callable[..., Any], bool]] = {}
        self._pool_lock = threading.Lock()
        if accepts_alloc(fn):
            self._out_pool = self._new_out_pool()
        self._free: collections.deque[torch.Tensor] = collections.deque()
        self._free_lock = threading.Lock()
        self._stop = threading.Event()
        self._runner: EditRunner | None = None
        self._io: Workers | None = None
        self._edit: Workers | None = None
        self._service = False
        self._pending: set[cf.Future[ItemResult]] = set()
        self._pending_lock = threading.Lock()
        self.pooled_outputs = 0
        self._watch = ServerWatch(ctx)
        self.fused = FusedPath(ctx, (fetch is None and store is None) or fused is not None,
                               fused)

    # ------------------------------------------------------------------ buffers
    def _new_out_pool(self) -> OutputPool:
        return OutputPool(self.max_in_flight + 1, self._alloc_result if self._native else None)

    def _pool_for(self, fn: Callable[..., Any]) -> OutputPool | None:
        """The output pool for an ``fn`` that takes ``alloc`` (None: it does not)."""
        if fn is self.fn:
            return self._out_pool
        with self._pool_lock:
            hit = self._takes_alloc.get(id(fn))
            if hit is None or hit[0] is not fn:
                if len(self._takes_alloc) > 16:
                    self._takes_alloc.clear()
                hit = self._takes_alloc[id(fn)] = (fn, accepts_alloc(fn))
            if not hit[1]:
                return None
            if self._out_pool is None:
                self._out_pool = self._new_out_pool()
            return self._out_pool

    def _take(self, tokens: int) -> torch.Tensor | None:
        if not self.reuse_buffers or tokens <= 0:
            return None
        with self._free_lock:
            for _ in range(len(self._free)):
                t = self._free.popleft()
                if t.shape[-2] >= tokens:
                    return t
                self._free.append(t)
        return self._alloc_result(self.ctx.kv_shape(tokens), self.ctx.dtype)

    def _give(self, t: torch.Tensor | None) -> None:
        if t is not None:
            with self._free_lock:
                if len(self._free) < self.max_in_flight:
                    self._free.append(t)

    # ------------------------------------------------------------------ stages
    def _finish(self, it: Item, exc: BaseException | None = None) -> None:
        self._give(it.buf)
        it.buf = it.kv = it.new_kv = None
        if self._out_pool is not None:
            self._out_pool.give_back(it.taken)
        if exc is not None:
            it.done.set_exception(exc)
        else:
            it.done.set_result(it.res)

    def _cancelled(self, it: Item) -> None:
        it.res.status, it.res.reason = "cancelled", "batch interrupted"
        self._finish(it)

    def _halted(self) -> bool:
        return self._stop.is_set() or self._watch.gone() is not None

    def _not_started(self, it: Item) -> None:
        """An item whose first stage did not run: not attempted (server gone) or cancelled."""
        if self._watch.gone() is None:
            return self._cancelled(it)
        it.res.status, it.res.reason = "not_attempted", "not attempted: the server is unavailable"
        return self._finish(it)

    def _dropped(self, it: Item) -> None:
        """A retrieved item that is not stored: cancelled (interrupt) or failed (server gone)."""
        if self._watch.gone() is None:
            return self._cancelled(it)
        res = it.res
        res.status, res.stage = "failed", "store"
        res.reason = "not stored: the batch stopped (ServerUnavailableError: the server is unavailable)"
        return self._finish(it)

    def _failed(self, it: Item, stage: str, err: Exception) -> None:
        """``it`` failed at ``stage``: after a server error, one liveness ping first."""
        it.res.fail(stage, err)
        it.res.error = None  # the traceback may hold tensors: not kept
        self._watch.after_failure(err)
        return self._finish(it)

    def _default_fetch(self, it: Item, salt: str) -> tuple[torch.Tensor | None, Sequence[int]]:
        toks = normalize_tokens(it.item)
        whole = len(toks) // self.ctx.chunk_size * self.ctx.chunk_size
        it.buf = self._take(whole)
        kv = self.ctx.retrieve(toks, salt, out=it.buf)
        return kv, toks

    def _stage_fused(self, it: Item, fn: Callable[..., Any]) -> None:
        """The whole item on this I/O thread: its rows slot to slot (batch/_fused.py)."""
        salt = self.salt if it.salt is None else it.salt
        try:
            self.fused.run(it.item, fn, salt, it.res)
        except Exception as err:
            return self._failed(it, self.fused.failed_stage(it.res), err)
        except BaseException as err:  # pragma: no cover - interrupt on an I/O thread
            self._interrupted()
            return self._finish(it, err)
        return self._finish(it)

    def _stage_fetch(self, it: Item) -> None:
        if self._halted():
            return self._not_started(it)
        self.census.apply()
        fn = self.fn if it.fn is None else it.fn
        edit = self.fused.edit_for(it.item, fn) if it.store_step is None else None
        if edit is not None:
            return self._stage_fused(it, edit)
        res = it.res
        t = time.perf_counter()
        try:
            if self._fetch_fn is None:
                kv, toks = self._default_fetch(it, self.salt if it.salt is None else it.salt)
            else:
                kv, toks = self._fetch_fn(self.ctx, it.item)
        except Exception as err:
            return self._failed(it, "retrieve", err)
        except BaseException as err:  # pragma: no cover - interrupt on an I/O thread
            self._interrupted()
            return self._finish(it, err)
        res.stages["retrieve"] = time.perf_counter() - t
        if kv is None:
            res.status, res.stage, res.reason = "missed", "retrieve", "nothing cached"
            return self._finish(it)
        hit = kv.shape[-2]
        res.tokens, res.nbytes = hit, nbytes(kv)
        it.kv, it.toks = kv, list(toks[:hit])
        assert self._edit is not None
        self._edit.submit(0, self._stage_edit, it)
        return None

    def _stage_edit(self, it: Item) -> None:
        if self._halted():
            return self._dropped(it)
        res, runner = it.res, self._runner
        assert runner is not None
        fn = self.fn if it.fn is None else it.fn
        pool = self._pool_for(fn)
        t = time.perf_counter()
        try:
            if pool is not None:
                taken, dt = it.taken, self.ctx.dtype
                new_kv, new_toks = runner.call(
                    fn, it.kv, it.toks,
                    alloc=lambda shape, dtype=dt: pool.alloc(shape, dtype, taken))
            else:
                new_kv, new_toks = runner.call(fn, it.kv, it.toks)
        except Exception as err:
            res.fail("fn", err)
            return self._finish(it)
        except BaseException as err:  # KeyboardInterrupt / SystemExit raised by fn
            self._interrupted()
            return self._finish(it, err)
        res.stages["fn"] = time.perf_counter() - t
        it.kv = None
        if it.buf is not None and not shares_memory(new_kv, it.buf):
            self._give(it.buf)  # the edit is elsewhere: the next retrieve may use it now
            it.buf = None
        it.new_kv, it.new_toks = new_kv, new_toks
        assert self._io is not None
        self._io.submit(0, self._stage_store, it)
        return None

    def _stage_store(self, it: Item) -> None:
        if self._watch.gone() is not None:
            return self._dropped(it)
        self.census.apply()
        res = it.res
        salt = self.salt if it.salt is None else it.salt
        t = time.perf_counter()
        try:
            if it.store_step is not None:
                res.value = it.store_step(res, it.new_kv, it.new_toks, salt)  # type: ignore[arg-type]
                err, res.error = res.error, None  # a failure the store step recorded
                if err is not None and res.status == "failed":
                    self._watch.after_failure(err)
                return self._finish(it)
            r = self._store_fn(it.new_kv, it.new_toks, salt)  # type: ignore[arg-type]
        except Exception as err:
            return self._failed(it, "store", err)
        except BaseException as err:  # pragma: no cover
            self._interrupted()
            return self._finish(it, err)
        res.stages["store"] = time.perf_counter() - t
        res.add_store(it.new_kv, r)  # type: ignore[arg-type]
        res.value, res.path = list(it.new_toks), "tensor"
        return self._finish(it)

    def _interrupted(self) -> None:
        """An interrupt in a stage: a batch stops; a long-lived engine fails only that item."""
        if not self._service:
            self._stop.set()

    # ------------------------------------------------------------------ threads
    def _start(self) -> None:
        self._runner = EditRunner(self.policy, self._alloc_result,
                                  grad_enabled=torch.is_grad_enabled(),
                                  inference_mode=torch.is_inference_mode_enabled())
        self._stop.clear()
        self.census.start()
        self._io = Workers(self.io_workers, "lmcache-kv-batch-io")
        self._edit = Workers(1, "lmcache-kv-batch-edit", self._runner.setup)

    def _stop_threads(self) -> int:
        """Stop the threads (queued stages run first); return the outputs pooled meanwhile."""
        assert self._edit is not None and self._io is not None and self._runner is not None
        self._edit.close()
        self._io.close()
        self._edit = self._io = None
        mode = self._runner.mode
        if self._runner.policy.threads is not None and not self._runner.threads_set:
            logger.debug("edit thread count not applied (no libgomp handle)")
        return mode.pooled if mode is not None else 0

    # ------------------------------------------------------------------ long-lived use
    def open(self) -> RewriteEngine:
        """Start the threads for :meth:`submit` (the caller's grad mode is taken now)."""
        if self._io is not None:
            raise KVCacheSDKError("this RewriteEngine is already running")
        self._service = True
        # a long-lived engine re-checks a server found gone after a while (it may be back)
        self._watch = ServerWatch(self.ctx, hold_s=max(self.ctx.timeout, 5.0))
        self._start()
        return self

    def submit(self, item: Any, index: int = 0, *, fn: Callable[..., Any] | None = None,
               cache_salt: str | None = None, store_step: StoreStepFn | None = None
               ) -> cf.Future[ItemResult]:
        """Queue one item on an :meth:`open` engine; returns the future of its result.

        Args:
            item: What ``fetch`` takes (default: a token sequence).
            index: Echoed in the result.
            fn: This item's edit (None: the engine's).
            cache_salt: This item's salt (None: the engine's).
            store_step: This item's store step, which also does the accounting (None: the
                engine's ``store`` and the batch accounting).

        The caller bounds how many items it has queued (memory); results come in any order.
        """
        if not self._service or self._io is None:
            raise KVCacheSDKError("RewriteEngine.submit needs open() first (and not close())")
        it = Item(index, item, ItemResult(index), fn=fn, salt=cache_salt,
                  store_step=store_step)
        with self._pending_lock:
            self._pending.add(it.done)
        it.done.add_done_callback(self._settled)
        self._io.submit(1, self._stage_fetch, it)
        return it.done

    def _settled(self, fut: cf.Future[ItemResult]) -> None:
        with self._pending_lock:
            self._pending.discard(fut)

    def close(self) -> None:
        """Wait for the submitted items, stop the threads (the context stays open)."""
        if not self._service:
            return
        with self._pending_lock:
            pending = list(self._pending)
        cf.wait(pending)
        self.pooled_outputs += self._stop_threads()
        self._service = False
        with self._free_lock:
            self._free.clear()

    # ------------------------------------------------------------------ driver
    def results(self, items: Iterable[Any], report: BatchReport | None = None,
                total: int | None = None) -> Iterator[ItemResult]:
        """Run the batch; yield each item's :class:`ItemResult` in input order.

        ``value`` of an ``ok`` item is its new token list. Cancelled items are counted in
        ``report.cancelled``, items not attempted (server gone) in
        ``report.not_attempted``; neither is yielded.

        Raises:
            ServerUnavailableError: The server was found gone (``err.report`` is ``report``).
        """
        if self._io is not None:
            raise KVCacheSDKError("this RewriteEngine is already running")
        rep = report if report is not None else BatchReport()
        self._watch = ServerWatch(self.ctx)  # per batch: a server found gone stops this batch
        self._start()
        run = _BatchRun(rep, Progress(total, self.desc, self.progress))
        t0 = time.perf_counter()
        try:
            source = enumerate(items)
            while True:
                self._fill(run, source)
                if not run.window:
                    break
                res = run.collect(run.window.popleft())
                if res is not None:
                    yield res
            self._raise_if_gone(rep)
        except BaseException:
            self._stop.set()  # items not started are cancelled, started server calls finish
            run.drain()
            raise
        finally:
            self._stop.set()
            rep.pooled_outputs += self._stop_threads()
            rep.seconds = time.perf_counter() - t0
            run.progress.close()

    def _fill(self, run: _BatchRun, source: Iterator[tuple[int, Any]]) -> None:
        """Start items from ``source`` until ``max_in_flight`` are alive (or none is left)."""
        if not run.exhausted and self._watch.gone() is not None:
            run.skip_rest(source)  # the server is gone: nothing more is sent
        assert self._io is not None
        while not run.exhausted and len(run.window) < self.max_in_flight:
            it = run.next_item(source, self.ctx.closed)
            if it is None:
                break
            run.window.append(it)
            self._io.submit(1, self._stage_fetch, it)
            run.rep.peak_in_flight = max(run.rep.peak_in_flight, len(run.window))

    def _raise_if_gone(self, rep: BatchReport) -> None:
        """Raise the watch's ``ServerUnavailableError`` (with ``rep``) if the server is gone."""
        gone = self._watch.gone()
        if gone is not None:
            rep.not_attempted_indices.sort()
            gone.report = rep
            raise gone

    def run(self, items: Iterable[Any], on_result: Callable[[ItemResult], None] | None = None,
            total: int | None = None) -> BatchReport:
        """Run the batch; call ``on_result`` per finished item in input order."""
        rep = BatchReport()
        gen = self.results(items, rep, total)
        try:
            for res in gen:
                if on_result is not None:
                    on_result(res)
        finally:
            gen.close()  # an exception in on_result stops the batch here, not at GC
        return rep


def run_rewrite(ctx: LMCacheKVCacheContext, items: Iterable[Any], fn: Callable[..., Any],
                *, on_result: Callable[[ItemResult], None] | None = None,
                **options: Any) -> BatchReport:
    """Run a :class:`RewriteEngine` over ``items`` (keyword options as its constructor)."""
    total = len(items) if isinstance(items, Sequence) else None
    return RewriteEngine(ctx, fn, **options).run(items, on_result, total)


__all__ = ["FetchFn", "RewriteEngine", "StoreFn", "StoreStepFn", "accepts_alloc", "run_rewrite"]
