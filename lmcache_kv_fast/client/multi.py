"""Many sequences at once: each request phase is sent for all before any reply is awaited.

A retrieve or a store of one sequence waits for the server's replies two or three times
(``client/retrieve.py``, ``client/store.py``); for many small sequences those round trips,
not the copies, are the time. :class:`MultiIO` runs the same flows for a list of
sequences phase by phase: every lookup is sent, then the replies are read and every
``prepare_retrieve`` sent, then the data is copied; every ``prepare_store`` is sent,
then the slots are filled and every ``commit_store`` sent, then the commits are
awaited. The server then answers the requests back to back instead of waiting for the
client between them.

Each sequence has its own channel (DEALER socket, kept in a small pool), so what a
timed-out sequence leaves on the server is settled exactly as for a single call: its
channel is retired with the same obligation (``client/late.py``: ``settle_late_lookup``,
the retrieve's and the store's late-reply settlers), and the other sequences go on. After
a timeout the group's other waits are short (the server is not answering: a dead server
costs one timeout per group, not one per sequence), as within one operation. Every
sequence holds its ``same_key`` lock from its first request to its release (the locks of
a group are taken in a fixed order; a key given twice is run in a later pass), read
locks are committed through the deferred releases, and a failure of one sequence is its
result only. SHM plane only (``supported``); tensors are the server's objects (a CPU
engine's rows, as ``raw=True``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lmcache_kv_fast.client.late import Obligation
from lmcache_kv_fast.client.lookup import (
    LATE_MARGIN_S,
    LookupCalls,
    free_locks,
    lookup_finish,
    lookup_send,
)
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError, ServerTimeoutError
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import (
    IPCCacheServerKey,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
)
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall
from lmcache_kv_fast.validation import check_kv, check_out, check_salt, normalize_tokens

if TYPE_CHECKING:
    from lmcache_kv_fast.context import LMCacheKVCacheContext

logger = logging.getLogger(__name__)

__all__ = ["MultiIO", "PendingRetrieve"]

#: One sequence's result: a tensor / StoreResult, None (nothing cached) or its error.
Outcome = Any
_T = TypeVar("_T")


class _Item:
    """One sequence of a group: what was sent for it and where it stands."""

    def __init__(self, index: int, toks: list[int], salt: str, tensor: torch.Tensor,
                 n: int) -> None:
        self.index, self.toks, self.salt, self.tensor, self.n = index, toks, salt, tensor, n
        self.same: tuple[str, int, int] = (salt, len(toks), hash(tuple(toks)))
        self.ch: Channel | None = None
        self.rid = ""
        self.lookup: LookupCalls | None = None
        self.keys: dict[int, IPCCacheServerKey] = {}
        self.calls: dict[int, PendingCall] = {}
        self.commits: list[PendingCall] = []
        self.written: list[set[int]] = []
        self.plans: list[Any] = []
        self.result: Outcome = None
        self.done = False


class PendingRetrieve:
    """A retrieve whose lookups were sent (:meth:`MultiIO.start_retrieve`)."""

    def __init__(self, items: list[_Item]) -> None:
        self.items = items
        self.op = contextlib.ExitStack()
        self.finished = not any(it.n > 0 for it in items)


class MultiIO:
    """Retrieve and store many sequences of one context with pipelined requests.

    Use from one thread at a time; :meth:`close` it (it returns its channels).

    Args:
        ctx: The context (SHM plane for the pipelined flows).
    """

    def __init__(self, ctx: LMCacheKVCacheContext) -> None:
        self._ctx = ctx
        self._s = ctx._session
        self._retrieval = ctx._retrieval
        self._storing = ctx._storing
        self._pool: list[Channel] = []
        self._started: list[PendingRetrieve] = []

    @property
    def supported(self) -> bool:
        """Whether the pipelined flows apply (the server's SHM plane)."""
        return self._s.shm is not None

    # ------------------------------------------------------------------ retrieve
    def retrieve_many(self, tokens: Sequence[Sequence[int]], salts: Sequence[str],
                      outs: Sequence[torch.Tensor]) -> list[Outcome]:
        """The cached prefix of every sequence, read into its ``out`` (server layout).

        Args:
            tokens: Token ids of each sequence (a trailing partial chunk is ignored).
            salts: Each sequence's salt.
            outs: Each sequence's destination ``ctx.kv_shape(T, raw=True)`` or larger.

        Returns:
            Per sequence: ``out`` narrowed to the hit, None (nothing cached, or fewer
            tokens than a chunk) or the :class:`KVCacheSDKError` it failed with.

        Raises:
            InvalidArgumentError / InvalidTypeError: An argument is malformed (nothing
                was sent).
        """
        return self.finish_retrieve(self.start_retrieve(tokens, salts, outs))

    def start_retrieve(self, tokens: Sequence[Sequence[int]], salts: Sequence[str],
                       outs: Sequence[torch.Tensor]) -> PendingRetrieve:
        """Send the lookups of :meth:`retrieve_many`; :meth:`finish_retrieve` does the rest.

        The caller may do other work (other calls of this object too) in between; the
        lookups' read locks are held until then. Every started retrieve must be finished
        (:meth:`close` finishes what is left).
        """
        s = self._s
        self._require(len(tokens) == len(salts) == len(outs), "tokens, salts and outs")
        items = []
        for i, (t, salt, out) in enumerate(zip(tokens, salts, outs, strict=True)):
            toks = normalize_tokens(t)
            n = len(toks) // s.chunk_size
            toks = toks[: n * s.chunk_size]
            items.append(_Item(i, toks, check_salt(salt),
                               check_out(out, len(toks), s.layout, s.dtype), n))
        pr = PendingRetrieve(items)
        live = [it for it in items if it.n > 0]
        if not live:
            return pr
        pr.op.enter_context(s.op())  # close() waits for it to finish
        self._started.append(pr)
        try:
            self._assign(live)
            for it in live:
                assert it.ch is not None
                it.rid = s.rid("r")
                it.lookup = lookup_send(s, it.ch, it.toks, it.rid, it.salt)
        except BaseException:
            self.finish_retrieve(pr)  # what was sent is finished (the rest: its error)
            raise
        return pr

    def finish_retrieve(self, pr: PendingRetrieve) -> list[Outcome]:
        """Finish a retrieve started by :meth:`start_retrieve`; its per-sequence results."""
        if pr.finished:
            return [it.result for it in pr.items]
        live = [it for it in pr.items if it.n > 0]
        keep = False
        try:
            for it in live:
                self._step(live, it, self._lookup_done)
            for group in _passes([it for it in live if not it.done]):
                with self._locked(group):
                    for it in group:
                        self._step(live, it, self._send_prepare)
                    for it in group:
                        self._step(live, it, self._finish_retrieve)
            keep = True
        finally:
            pr.finished = True
            self._release(live, keep=keep)
            pr.op.close()
            if pr in self._started:
                self._started.remove(pr)
        return [it.result for it in pr.items]

    def _lookup_done(self, it: _Item) -> None:
        s, ch = self._s, it.ch
        if ch is None or it.lookup is None:
            raise KVCacheSDKError("the retrieve was interrupted before its lookup was sent")
        try:
            hit = lookup_finish(s, ch, it.lookup)
        except BaseException:
            if not ch.retired:
                s.end_session(ch, it.rid)
            raise
        if hit == 0:
            s.end_session(ch, it.rid)
            it.result, it.done = None, True
            return
        it.n = hit
        it.toks = it.toks[: hit * s.chunk_size]
        it.same = (it.salt, len(it.toks), hash(tuple(it.toks)))  # the key of the prepare

    def _send_prepare(self, it: _Item) -> None:
        s, ch = self._s, it.ch
        assert ch is not None
        end = it.n * s.chunk_size
        ranks = [0] if s.layout.planes == 1 else list(range(s.world_size))
        it.keys = {r: s.key(it.toks, 0, end, it.rid, it.salt, r) for r in range(s.world_size)}
        it.calls = {r: ch.send(Op.PREPARE_RETRIEVE, [it.keys[r], s.instance_id]) for r in ranks}

    def _finish_retrieve(self, it: _Item) -> None:
        """Wait for the prepares, copy, release (the flow of ``RetrieveFlow._fetch``)."""
        s, ch, n = self._s, it.ch, it.n
        assert ch is not None
        ranks = sorted(it.calls)
        resps: dict[int, PrepareRetrieveResponse] = {}
        try:
            for r in ranks:
                resps[r] = ch.wait(it.calls[r], PrepareRetrieveResponse)
        except ServerTimeoutError:
            ob = Obligation(f"retrieve {it.rid}: commit or free the read locks of {n} chunks "
                            "and end its session",
                            time.monotonic() + s.read_ttl_s + LATE_MARGIN_S, key=it.same)
            ob.settler = self._retrieval._late(ch, it.keys, it.rid, it.calls, resps, ranks)
            s.late.adopt(ch, ob)
            raise
        except BaseException:
            for r in ranks:
                ch.discard(it.calls[r])
            for r in range(s.world_size):
                free_locks(s, ch, it.keys[r], r)
            s.end_session(ch, it.rid)
            raise
        commits: list[list[Any]] = []
        try:
            if all(resps[r].success for r in ranks):
                for r in ranks:
                    regions = self._retrieval._regions(resps[r], n, "prepare_retrieve")
                    s.copy(s.backend.gather, it.tensor, range(n), regions, s.shard_cols[r])
                it.result = it.tensor.narrow(-2, 0, n * s.chunk_size)
        finally:
            for r in range(s.world_size):
                if r in resps and resps[r].success:
                    commits.append([it.keys[r], s.instance_id])
                else:
                    free_locks(s, ch, it.keys[r], r)
            if commits:  # under the key's lock; the session ends after the commits
                self._retrieval._release_reads(commits, it.rid, it.same)
            else:
                s.end_session(ch, it.rid)
        it.done = True

    # ------------------------------------------------------------------ store
    def store_many(self, kvs: Sequence[torch.Tensor], tokens: Sequence[Sequence[int]],
                   salts: Sequence[str]) -> list[Outcome]:
        """Store every ``kv`` (server layout) under its tokens (whole chunks).

        Returns:
            Per sequence: its :class:`StoreResult` (as ``store_ex``) or the
            :class:`KVCacheSDKError` it failed with.

        Raises:
            InvalidArgumentError / InvalidTypeError: An argument is malformed (nothing
                was sent).
        """
        s = self._s
        self._require(len(kvs) == len(tokens) == len(salts), "kvs, tokens and salts")
        items = []
        results: list[Outcome] = [None] * len(kvs)
        for i, (kv, t, salt) in enumerate(zip(kvs, tokens, salts, strict=True)):
            src = check_kv(kv, s.layout, s.dtype)
            toks = normalize_tokens(t)
            if len(toks) != src.shape[2]:
                raise InvalidArgumentError(
                    f"sequence {i}: len(tokens) is {len(toks)} but kv has {src.shape[2]} "
                    "tokens (dimension -2); they must be equal")
            n = len(toks) // s.chunk_size
            items.append(_Item(i, toks[: n * s.chunk_size], check_salt(salt), src, n))
            results[i] = StoreResult(0, 0, 0, 0, 0)
        for group in _passes([it for it in items if it.n > 0]):
            self._run(group, self._store_group)
            for it in group:
                results[it.index] = it.result
        ev = sys.modules.get("lmcache_kv_fast.events")
        for it in items:
            r = results[it.index]
            if ev is not None and isinstance(r, StoreResult) and r.tokens_stored and \
                    ev.has_listeners(s.model_name):
                ev.announce_store(self._ctx, it.toks, it.salt, r.tokens_stored // s.chunk_size)
        return results

    def _store_group(self, group: list[_Item]) -> None:
        s = self._s
        for it in group:
            assert it.ch is not None
            it.rid = s.rid("s")
            end = it.n * s.chunk_size
            it.keys = {r: s.key(it.toks, 0, end, it.rid, it.salt, r)
                       for r in range(s.world_size)}
            it.calls = {r: it.ch.send(Op.PREPARE_STORE, [it.keys[r], s.writer_id])
                        for r in range(s.world_size)}
        for it in group:
            self._step(group, it, self._fill)
        for it in group:
            self._step(group, it, self._commit, always=True)

    def _fill(self, it: _Item) -> None:
        """Wait for the reservations, write them, send the commits (``_store_shm``)."""
        s, st, ch, n = self._s, self._storing, it.ch, it.n
        assert ch is not None
        ws = s.world_size
        calls = [it.calls[r] for r in range(ws)]
        resps: list[PrepareStoreResponse | None] = [None] * ws
        keys = [it.keys[r] for r in range(ws)]
        it.written = [set() for _ in range(ws)]
        pinned = True
        try:
            try:
                for r, c in enumerate(calls):
                    resps[r] = ch.wait(c, PrepareStoreResponse)
            except ServerTimeoutError:
                st._late_prepare(ch, it.tensor, n, keys, it.rid, calls, resps, it.same)
                raise
            except BaseException:
                for c in calls:
                    ch.discard(c)
                raise
            it.plans = st._plans(resps, n)
            todo = [p for p in it.plans if p.idx]
            if todo:
                st._check_age(calls[0].sent_at)  # before a byte goes into the slots
                for p in todo:
                    st._scatter(it.tensor, p, s.copy)
                st._check_age(calls[0].sent_at)  # the commit admits them
            for p in todo:
                it.commits.append(ch.send(Op.COMMIT_STORE, [keys[p.rank], s.writer_id],
                                          raw=[codec.encode(b"")]))
                it.written[p.rank] = set(p.idx)
            pinned = False
        finally:
            if pinned and not ch.retired:
                s.uncommitted += 1

    def _commit(self, it: _Item) -> None:
        """Wait for the commits, end the session, say what is cached (``_store_shm``)."""
        s, st, ch, n = self._s, self._storing, it.ch, it.n
        assert ch is not None
        ok_commits = st._finish(ch, it.commits, it.rid, pins_writer=True)
        if it.done:  # failed before its commits: _finish only ended its session
            return
        all_written = set(range(n))
        for w in it.written:
            all_written &= w
        end = n * s.chunk_size
        if ok_commits and len(all_written) == n:
            it.result = StoreResult(end, n, n, 0, 0)
        else:
            k = st._settled_prefix(st._after(ch), it.toks, it.salt, n)
            n_written = len([i for i in all_written if i < k]) if ok_commits else 0
            present = min(k, n)
            cached = max(0, present - n_written)
            it.result = StoreResult(present * s.chunk_size, n, n_written, cached, n - present)
        it.done = True

    # ------------------------------------------------------------------ common
    def _run(self, group: list[_Item], body: Callable[[list[_Item]], None]) -> None:
        """Run ``body`` over ``group`` as one operation, each item on its own channel."""
        with self._s.op(), self._locked(group):
            self._assign(group)
            try:
                body(group)
            except BaseException:
                self._release(group, keep=False)
                raise
            self._release(group, keep=True)

    @contextlib.contextmanager
    def _locked(self, group: list[_Item]) -> Iterator[None]:
        """Hold the ``same_key`` lock of every item (distinct keys; in a fixed order)."""
        with contextlib.ExitStack() as locks:
            for it in sorted(group, key=lambda x: x.same):
                locks.enter_context(self._s.same_key(it.salt, it.toks))
            yield

    def _assign(self, group: list[_Item]) -> None:
        """Give every item a channel of the pool (fresh ones when it runs out)."""
        s = self._s
        lost = False
        for it in group:
            it.ch = self._channel()
            it.ch.unresponsive = False
            lost |= it.ch.peer_lost()
        if lost or s.peer_lost:
            s.check_registration()

    def _release(self, group: list[_Item], *, keep: bool) -> None:
        """Return the items' channels to the pool (a retired one belongs to its settler).

        ``keep=False`` (the call was interrupted: requests may still be in flight): the
        channels are left to the client, which closes them with the context.
        """
        for it in group:
            ch, it.ch = it.ch, None
            if keep and ch is not None and not ch.retired:
                self._pool.append(ch)

    def _step(self, group: list[_Item], it: _Item, fn: Callable[[_Item], None], *,
              always: bool = False) -> None:
        """Run one phase of ``it``; a failure becomes its result."""
        if it.done and not always:
            return
        try:
            fn(it)
        except Exception as exc:  # one sequence's failure is its result only
            err = exc if isinstance(exc, KVCacheSDKError) else KVCacheSDKError(
                f"{type(exc).__name__}: {exc}")
            it.result, it.done = err, True
            if isinstance(err, ServerTimeoutError):  # the server is not answering
                for other in group:
                    if other.ch is not None and not other.ch.retired:
                        other.ch.unresponsive = True
            logger.debug("sequence %d failed: %s", it.index, err)

    def _channel(self) -> Channel:
        if self._pool:
            return self._pool.pop()
        assert self._s.zmq is not None
        return self._s.zmq.new_channel()

    @staticmethod
    def _require(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidArgumentError(f"{what} must have the same length")

    def close(self) -> None:
        """Collect the acknowledgements of the pool's fired calls and close its channels."""
        s = self._s
        for pr in list(self._started):  # started and never finished: finish it now
            with contextlib.suppress(KVCacheSDKError):
                self.finish_retrieve(pr)
        pool, self._pool = self._pool, []
        for ch in pool:
            if s.zmq is not None and not s.zmq.closing:
                with contextlib.suppress(KVCacheSDKError):
                    ch.settle(min(s.timeout, 1.0))
                s.zmq.drop(ch)

    def __enter__(self) -> MultiIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _passes(items: list[_T]) -> list[list[_T]]:
    """Split items into passes in which no ``same`` key repeats (first come, first pass)."""
    passes: list[list[_T]] = []
    seen: list[set[Any]] = []
    for it in items:
        key = it.same  # type: ignore[attr-defined]
        for p, keys in zip(passes, seen, strict=True):
            if key not in keys:
                p.append(it)
                keys.add(key)
                break
        else:
            passes.append([it])
            seen.append({key})
    return passes
