"""A long-lived pipelined item engine over one context (one per actor / Ray Data worker).

Rewrite items run on the engine under ``batch.rewrite`` itself
(:class:`~lmcache_kv_fast.batch.RewriteEngine`, opened once and fed item by item
with :meth:`~lmcache_kv_fast.batch.RewriteEngine.submit`: I/O threads, the edit
thread with pooled outputs, warm buffers across calls), with this module's store step
(verification, hashes); store and retrieve items run the flow of ``store_many`` /
``retrieve_many`` (same calls, the same :class:`~lmcache_kv_fast.batch.ItemResult`
accounting) on a small thread pool. Items arrive over time from several callers (Ray
calls) instead of from one iterable.

On top of batch's per-item flow it adds what a fleet needs:

* ``verify`` (set on a retry after a lost actor): the part of the item's output that is
  already cached (what the lost attempt stored) is read back and compared byte for byte
  with this attempt's output *before* anything is stored; a difference fails the item at
  stage ``verify`` and stores nothing, instead of mixing two attempts' results (see
  docs/distributed.md, "Faults").
* ``want_hashes``: return the server chunk hashes of what was stored (feeds a
  :class:`~lmcache_kv_fast.distributed.events_index.KVEventsIndex`; the server announces
  no SDK store, docs/protocol.md §11, defect 21).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_kv_fast.batch import DEFAULT_MAX_IN_FLIGHT, ItemResult, RewriteEngine
from lmcache_kv_fast.client.context import LMCacheKVCacheContext
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError
from lmcache_kv_fast.validation import normalize_tokens

logger = logging.getLogger(__name__)

OPS = ("rewrite", "store", "retrieve")


@dataclass
class Outcome:
    """What one item did on one server (picklable: it crosses Ray).

    Attributes:
        index: The item's index in the caller's batch.
        status: ``ok`` | ``missed`` | ``failed``.
        stage: Where it missed/failed (``route``, ``retrieve``, ``fn``, ``store``,
            ``verify``, ``actor``).
        reason: Why.
        tokens: Tokens moved (retrieved plus stored), as in :class:`BatchReport`.
        nbytes: KV bytes moved.
        stages: Seconds per stage.
        refused: Chunks the store could not place (staged by someone else, or L1 full).
        hashes: Chunk hashes of the stored output (with ``want_hashes``).
        value: ``retrieve``: the KV tensor (None on a miss).
    """

    index: int
    status: str = "ok"
    stage: str = ""
    reason: str = ""
    tokens: int = 0
    nbytes: int = 0
    stages: dict[str, float] = field(default_factory=dict)
    refused: int = 0
    hashes: list[bytes] | None = None
    value: Any = None


def _outcome(res: ItemResult, refused: int = 0) -> Outcome:
    return Outcome(res.index, res.status, res.stage, res.reason, res.tokens, res.nbytes,
                   dict(res.stages), refused)


def _no_fn(kv: Any, tokens: Any) -> Any:  # pragma: no cover - every rewrite item brings its fn
    raise KVCacheSDKError("a rewrite item came without its fn")


class ItemEngine:
    """Runs rewrite / store / retrieve items on one context, pipelined, from any thread.

    At most ``max_in_flight`` items are alive at once (``submit`` blocks beyond that).
    Rewrite items run on a :class:`~lmcache_kv_fast.batch.RewriteEngine` (the
    engine of ``batch.rewrite``: ``workers`` I/O threads, default ``min(max_in_flight, 2)``,
    and one edit thread); store / retrieve items on ``workers`` threads (default
    ``min(max_in_flight, 4)``).

    Args:
        ctx: A connected context (the engine does not close it).
        max_in_flight: Items alive at once (memory bound: ``max_in_flight × largest KV``).
        workers: I/O threads (None: see above).
        reuse_buffers: Read rewrite inputs into reused buffers.
    """

    def __init__(self, ctx: LMCacheKVCacheContext, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 workers: int | None = None, reuse_buffers: bool = True) -> None:
        if not isinstance(ctx, LMCacheKVCacheContext):
            raise InvalidArgumentError(f"ctx must be an LMCacheKVCacheContext, got {type(ctx).__name__}")
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be a positive int, got {max_in_flight!r}")
        if workers is not None and (type(workers) is not int or workers < 1):
            raise InvalidArgumentError(f"workers must be a positive int, got {workers!r}")
        self.ctx = ctx
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        n_io = workers or min(max_in_flight, 4)
        self._io_pool = cf.ThreadPoolExecutor(n_io, thread_name_prefix="lmckv-fleet-io")
        self._rw = RewriteEngine(ctx, _no_fn, max_in_flight=max_in_flight, io_workers=workers,
                                 reuse_buffers=reuse_buffers).open()
        self._closed = False

    # ------------------------------------------------------------------ public
    def submit(self, op: str, index: int, payload: Any, *, fn: Callable[..., Any] | None = None,
               cache_salt: str = "", verify: bool = False, want_hashes: bool = False
               ) -> cf.Future[Outcome]:
        """Queue one item; blocks while ``max_in_flight`` items are alive.

        Args:
            op: ``rewrite`` (payload: tokens), ``store`` (payload: ``(kv, tokens)``) or
                ``retrieve`` (payload: tokens).
            index: The item's index (echoed in the outcome).
            payload: See ``op``.
            fn: The edit (``rewrite``).
            cache_salt: Salt of reads and writes.
            verify: Compare output chunks found already cached with this attempt's output.
            want_hashes: Return the chunk hashes of the stored output.

        Returns:
            A future of the item's :class:`Outcome` (it never raises for item errors).
        """
        if op not in OPS:
            raise InvalidArgumentError(f"op must be one of {OPS}, got {op!r}")
        if op == "rewrite" and not callable(fn):
            raise InvalidArgumentError(f"rewrite needs a callable fn, got {type(fn).__name__}")
        if self._closed:
            raise KVCacheSDKError("the item engine is closed")
        self._slots.acquire()
        try:
            if op == "rewrite":
                fut = self._submit_rewrite(index, payload, fn, cache_salt, verify,  # type: ignore[arg-type]
                                           want_hashes)
            else:
                fut = self._io_pool.submit(self._task, op, index, payload, cache_salt, verify,
                                           want_hashes)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        return fut

    def run(self, op: str, items: Sequence[tuple[int, Any]], **kw: Any) -> list[Outcome]:
        """Run ``(index, payload)`` items (see :meth:`submit`); outcomes in input order."""
        futs = [self.submit(op, i, p, **kw) for i, p in items]
        return [f.result() for f in futs]

    def lookup_many(self, token_lists: Sequence[Any], cache_salt: str = "") -> list[int]:
        """Cached prefix length (tokens) of each sequence; -1 where the lookup failed."""
        def one(toks: Any) -> int:
            try:
                return self.ctx.lookup(toks, cache_salt)
            except KVCacheSDKError as err:
                logger.warning("lookup on %s failed: %s", self.ctx.url, err)
                return -1
        return list(self._io_pool.map(one, token_lists))

    def close(self) -> None:
        """Wait for running items; stop the threads (the context stays open)."""
        self._closed = True
        self._rw.close()
        self._io_pool.shutdown(wait=True)

    # ------------------------------------------------------------------ items
    def _submit_rewrite(self, index: int, toks: Any, fn: Callable[..., Any], salt: str,
                        verify: bool, want_hashes: bool) -> cf.Future[Outcome]:
        """One rewrite item on the rewrite engine, with this module's store step."""
        def store(res: ItemResult, kv: torch.Tensor, new_toks: Any, s: str) -> Outcome:
            return self._store_checked(res, kv, new_toks, s, verify, want_hashes)

        out: cf.Future[Outcome] = cf.Future()
        # a library edit goes slot to slot (batch/_fused.py); verify reads the edit's KV
        fused = not verify and self._rw.fused.takes(fn)

        def done(f: cf.Future[ItemResult]) -> None:
            err = f.exception()
            if err is not None:  # an interrupt raised by fn fails this item only
                out.set_result(_outcome(ItemResult(index).fail("fn", err)))
                return
            res = f.result()
            if res.status in ("not_attempted", "cancelled"):  # the fleet knows ok/missed/failed
                res.status, res.stage = "failed", res.status
            if isinstance(res.value, Outcome):
                out.set_result(res.value)
            else:
                out.set_result(self._fused_outcome(res, want_hashes) if fused else _outcome(res))

        self._rw.submit(toks, index, fn=fn, cache_salt=salt,
                        store_step=None if fused else store).add_done_callback(done)
        return out

    def _fused_outcome(self, res: ItemResult, want_hashes: bool) -> Outcome:
        """The outcome of an item rewritten slot to slot (its stored chunks' hashes)."""
        out = _outcome(res)
        if want_hashes and res.status == "ok" and res.value:
            out.hashes = self._hashes(res.value)
        return out

    def _hashes(self, toks: Any) -> list[bytes] | None:
        """Hashes of the whole chunks of ``toks`` (None when blake3 is missing)."""
        from lmcache_kv_fast.hashing import chunk_hashes

        c = self.ctx.chunk_size
        whole = normalize_tokens(toks)
        try:
            return chunk_hashes(whole[: len(whole) // c * c], c)
        except KVCacheSDKError as err:  # blake3 missing: the index just learns nothing
            logger.warning("cannot hash the stored chunks for the events index: %s", err)
            return None

    def _task(self, op: str, index: int, payload: Any, salt: str, verify: bool,
              want_hashes: bool) -> Outcome:
        try:
            if op == "store":
                return self._store(index, payload, salt, verify, want_hashes)
            return self._retrieve(index, payload, salt)
        except Exception as err:  # never let one item take the caller down
            logger.exception("item %d (%s) failed unexpectedly", index, op)
            return _outcome(ItemResult(index).fail(op, err))

    def _retrieve(self, index: int, toks: Any, salt: str) -> Outcome:
        res = ItemResult(index)
        t = time.perf_counter()
        try:
            kv = self.ctx.retrieve(toks, salt)
        except Exception as err:
            return _outcome(res.fail("retrieve", err))
        res.stages["retrieve"] = time.perf_counter() - t
        if kv is None:
            res.status, res.stage, res.reason = "missed", "retrieve", "nothing cached"
        else:
            res.tokens, res.nbytes = kv.shape[-2], kv.numel() * kv.element_size()
        out = _outcome(res)
        out.value = kv
        return out

    def _store(self, index: int, item: Any, salt: str, verify: bool, want_hashes: bool) -> Outcome:
        res = ItemResult(index)
        try:
            kv, toks = item
        except (TypeError, ValueError) as err:
            return _outcome(res.fail("store", err))
        return self._store_checked(res, kv, toks, salt, verify, want_hashes)

    def _store_checked(self, res: ItemResult, kv: torch.Tensor, toks: Any, salt: str,
                       verify: bool, want_hashes: bool) -> Outcome:
        """Store (as ``batch`` does); with ``verify``, first compare what is already cached.

        A retry must not add its chunks to an earlier attempt's different result: the
        cached prefix of the output is read back and compared before anything is stored
        (a conflict fails the item and stores nothing), and whatever else the store finds
        already cached (a gap) is compared after it.
        """
        verified = 0
        if verify:
            t = time.perf_counter()
            try:
                verified = self.ctx.lookup(toks, salt)
            except Exception as err:
                return _outcome(res.fail("verify", err))
            why = self._differs(kv, toks, verified, salt) if verified else ""
            res.stages["verify"] = time.perf_counter() - t
            if why:
                res.status, res.stage, res.reason = "failed", "verify", why
                return _outcome(res)
        t = time.perf_counter()
        try:
            r = self.ctx.store_ex(kv, toks, salt)
        except Exception as err:
            return _outcome(res.fail("store", err))
        res.stages["store"] = time.perf_counter() - t
        res.add_store(kv, r)
        out = _outcome(res, refused=r.chunks_refused)
        cached_toks = r.chunks_already_cached * self.ctx.chunk_size
        if verify and r.tokens_stored and cached_toks > verified:
            t = time.perf_counter()
            why = self._differs(kv, toks, r.tokens_stored, salt, stored=True)
            out.stages["verify"] = out.stages.get("verify", 0.0) + time.perf_counter() - t
            if why:
                out.status, out.stage, out.reason = "failed", "verify", why
                return out
        if want_hashes and r.tokens_stored:
            out.hashes = self._hashes(normalize_tokens(toks)[: r.tokens_stored])
        return out

    def _differs(self, kv: torch.Tensor, toks: Any, n: int, salt: str, *, stored: bool = False) -> str:
        """Empty when the cached ``toks[:n]`` equal ``kv[..., :n, :]`` (or are gone), else why not."""
        try:
            got = self.ctx.retrieve(normalize_tokens(toks)[:n], salt)
        except Exception as err:
            return f"could not read the cached output back to verify it: {type(err).__name__}: {err}"
        if got is None:  # evicted meanwhile: nothing left that could be served wrong
            return ""
        m = got.shape[-2]
        mine = kv.reshape(got.shape[:-2] + kv.shape[-2:])[..., :m, :] if kv.dim() != got.dim() \
            else kv[..., :m, :]
        if torch.equal(got, mine):
            return ""
        return ("conflict: the server already held chunks of this item's output with other "
                "content (an earlier attempt on a lost actor stored a different result: fn "
                "is not deterministic, or its input changed, e.g. the source KV was partly "
                "evicted); they were not overwritten"
                + ("" if stored else " and nothing of this attempt was stored"))
