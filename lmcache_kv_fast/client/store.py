"""Store: write a KV tensor under its token ids, and say what happened to every chunk.

SHM plane: ``prepare_store`` (one per shard) → scatter into the reserved slots →
``commit_store`` (awaited: ``store()`` promises the chunks are visible when it returns) →
``end_session``. Inline plane (no SHM): a lookup skips the cached prefix, then one
``commit_store`` per shard carries the chunks, pickled up to 0.5.6, in a msgpack
``TensorEnvelope`` from 0.5.7 (docs/protocol.md §7.4, §7.6). When some chunk got no slot,
lookups tell "already cached" (or being written by another client) from "L1 full"
(docs/protocol.md §11 #10).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lmcache_kv_fast.client.late import SNAPSHOT_BUDGET_BYTES, Obligation, Settler
from lmcache_kv_fast.client.lookup import LATE_MARGIN_S, lookup_release
from lmcache_kv_fast.client.read_hints import ReadHints
from lmcache_kv_fast.copy import Region
from lmcache_kv_fast.dataplane.envelope import EnvelopeFrameBuilder
from lmcache_kv_fast.dataplane.pickle_fast import ChunkFrameBuilder
from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError, ServerTimeoutError
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import CacheKey, PrepareStoreResponse, Slot
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall

if TYPE_CHECKING:
    from lmcache_kv_fast.client.session import Session

logger = logging.getLogger(__name__)

#: Re-lookups after a store whose chunks were staged by another writer (seconds apart).
SETTLE_DELAYS_S = (0.005, 0.02, 0.05)
#: A reservation is written and committed only within this fraction of the write TTL.
WRITE_TTL_USE = 0.75


class RowSource(Protocol):
    """What a store writes from instead of a tensor: a fused rewrite's planned rows."""

    #: Bytes of the KV it writes as a ``[P, L, T, D]`` tensor (a late snapshot's size).
    nbytes: int

    def write(self, rank: int, chunk_ids: list[int], regions: list[Region]) -> None:
        """Write chunks ``chunk_ids`` of shard ``rank`` into ``regions`` (whole)."""
        ...

    def materialize(self) -> torch.Tensor:
        """The KV it writes as a ``[P, L, T, D]`` tensor (for a late reservation)."""
        ...


@dataclass
class _Plan:
    """Where one shard's reserved chunks go."""

    rank: int
    idx: list[int]
    regions: list[Region]
    slots: list[Slot]


class StoreFlow:
    """The store of one session.

    Args:
        session: The session it runs on.
        hints: The session's read hints (a store that wrote every chunk records its slots).
    """

    def __init__(self, session: Session, hints: ReadHints) -> None:
        self._s = session
        self._hints = hints
        self._builder: ChunkFrameBuilder | EnvelopeFrameBuilder | None = None

    def store(self, src: torch.Tensor, toks: list[int], salt: str, n: int,
              rc: dict[str, Any] | None, t0: float) -> StoreResult:
        """Store the ``n`` whole chunks of a validated ``[P, L, T, D]`` ``src``."""
        s = self._s
        with s.op(rc, name="store", t0=t0) as ch, s.same_key(salt, toks) as key:
            if s.shm is not None:
                return self._store_shm(ch, src, toks, salt, n, key)
            return self._store_inline(ch, src, toks, salt, n)

    def _store_shm(self, ch: Channel, src: torch.Tensor | RowSource, toks: list[int],
                   salt: str, n: int, same_key: tuple[str, int, int]) -> StoreResult:
        """Store into reserved SHM slots; ``src`` a tensor or a fused rewrite's rows."""
        s = self._s
        rid = s.rid("s")
        end = n * s.chunk_size
        ws = s.world_size
        wid = s.writer_id
        keys = [s.key(toks, 0, end, rid, salt, r) for r in range(ws)]
        calls = [ch.send(Op.PREPARE_STORE, [keys[r], wid]) for r in range(ws)]
        resps: list[PrepareStoreResponse | None] = [None] * ws
        written = [set() for _ in range(ws)]
        commits: list[PendingCall] = []
        plans: list[_Plan] = []
        # Until every reservation is committed (or known not to exist), one may be left on
        # the server: then the writer is pinned (never unregistered, so never admitted).
        pinned = True
        try:
            try:
                for r, c in enumerate(calls):
                    resps[r] = ch.wait(c, PrepareStoreResponse)
            except ServerTimeoutError:
                self._late_prepare(ch, src, n, keys, rid, calls, resps, same_key)
                raise
            except BaseException:
                for c2 in calls:
                    ch.discard(c2)
                raise
            plans = self._plans(resps, n)
            todo = [p for p in plans if p.idx]
            if todo:
                self._check_age(calls[0].sent_at)  # before a byte goes into the slots
                for p in todo:
                    self._fill(src, p)
                    s.tls.chunks = max(s.tls.chunks, len(p.idx))
                self._check_age(calls[0].sent_at)  # the commit admits them
            for p in todo:
                commits.append(ch.send(Op.COMMIT_STORE, [keys[p.rank], wid],
                                       raw=[codec.encode(b"")]))
                written[p.rank] = set(p.idx)
            pinned = False
        finally:
            if pinned and not ch.retired:
                s.uncommitted += 1
            ok_commits = self._finish(ch, commits, rid, pins_writer=True)
        all_written = set(range(n))
        for w in written:
            all_written &= w
        if ok_commits and len(all_written) == n:
            hint_key = self._hints.key(same_key)
            if hint_key is not None:  # a retrieve of this prefix may read these slots early
                for p in plans:
                    by_chunk = sorted(zip(p.idx, range(len(p.idx)), strict=True))
                    self._hints.remember((*hint_key, p.rank), [p.slots[j] for _, j in by_chunk])
            return StoreResult(end, n, n, 0, 0)
        k = self._settled_prefix(self._after(ch), toks, salt, n)
        n_written = len([i for i in all_written if i < k]) if ok_commits else 0
        present = min(k, n)
        cached = max(0, present - n_written)
        return StoreResult(present * s.chunk_size, n, n_written, cached, n - present)

    def _plans(self, resps: Sequence[PrepareStoreResponse | None], n: int) -> list[_Plan]:
        """Validate every shard's reply (indices, slots against the mapping).

        Raises:
            ProtocolError: A reply does not fit.
        """
        s = self._s
        shm = s.shm
        assert shm is not None
        plans = []
        for r, resp in enumerate(resps):
            assert resp is not None
            ctxt = resp.context
            idx = ctxt.chunk_indices
            if len(idx) != len(ctxt.slots) or len(set(idx)) != len(idx) or \
                    any(not 0 <= i < n for i in idx):
                raise ProtocolError(
                    f"prepare_store: chunk_indices {idx[:8]} do not match "
                    f"{len(ctxt.slots)} slots of a {n}-chunk store"
                )
            regions = shm.regions(ctxt.slots, s.geom, s.layout.dtype_str, "prepare_store")
            plans.append(_Plan(r, idx, regions, ctxt.slots))
        return plans

    def store_locked(self, ch: Channel, src: torch.Tensor | RowSource, toks: list[int],
                     salt: str, n: int, same_key: tuple[str, int, int]) -> StoreResult:
        """Store ``n`` chunks under ``toks`` within a caller's operation (SHM, key locked)."""
        return self._store_shm(ch, src, toks, salt, n, same_key)

    def _fill(self, src: torch.Tensor | RowSource, p: _Plan) -> None:
        """Write ``p``'s chunks from a tensor (scatter) or from a fused rewrite's rows."""
        if isinstance(src, torch.Tensor):
            return self._scatter(src, p, self._s.copy)
        t0 = time.perf_counter()
        try:
            src.write(p.rank, p.idx, p.regions)
        except OSError as err:
            raise self._pool_error(len(p.idx), err) from err
        finally:
            self._s.tls.copy_s += time.perf_counter() - t0
        return None

    def _pool_error(self, chunks: int, err: OSError) -> KVCacheSDKError:
        """The error of a failed write into the server's pool file."""
        assert self._s.shm is not None
        return KVCacheSDKError(
            f"cannot write {chunks} chunks into the server's SHM pool "
            f"/dev/shm/{self._s.shm.name}: {err}"
            + (" (the file system holding /dev/shm is full)" if err.errno == errno.ENOSPC
               else ""))

    def _scatter(self, src: torch.Tensor, p: _Plan, copy: Any) -> None:
        """Write the chunks ``p.idx`` of ``src`` into their reserved slots.

        Raises:
            KVCacheSDKError: The pool file could not be written.
        """
        s = self._s
        try:
            copy(s.backend.scatter, src, p.idx, p.regions, s.shard_cols[p.rank])
        except OSError as err:  # pwritev into the pool file (native backend)
            raise self._pool_error(len(p.idx), err) from err

    def _check_age(self, reserved_after: float) -> None:
        """Refuse to write or commit a reservation that may have outlived its write TTL.

        An expired reservation may have been handed to another writer or freed and
        reused for another object: writing into it would corrupt that one.

        Raises:
            KVCacheSDKError: It is too old (nothing may be written or committed).
        """
        s = self._s
        age = time.monotonic() - reserved_after
        if age > s.write_ttl_s * WRITE_TTL_USE:
            raise KVCacheSDKError(
                f"store: the server's reservation is {age:.0f}s old, too close to its "
                f"{s.write_ttl_s:g}s write TTL (--l1-write-ttl-seconds) to write or commit "
                "it safely; nothing was committed"
            )

    def _after(self, ch: Channel) -> Channel:
        """The channel to go on with: a fresh one if ``ch`` was retired after a timeout.

        Its waits are short, like those after a timeout on the same channel (a dead server
        costs one timeout per operation, not one per call).
        """
        if not ch.retired:
            return ch
        assert self._s.zmq is not None
        fresh = self._s.zmq.channel()
        fresh.unresponsive = True
        return fresh

    def _finish(self, ch: Channel, commits: list[PendingCall], rid: str, *,
                pins_writer: bool) -> bool:
        """Wait for the commits, then end the session; True when every commit said True.

        A commit that times out may still run (then the data, written in full, becomes
        visible late): the channel is retired with an obligation that waits for it, then
        ends the session (``client/late.py``), and False is returned (the caller verifies
        by lookup what is cached now).
        """
        s = self._s
        if ch.retired:
            return False
        ok = True
        for i, c in enumerate(commits):
            try:
                ok &= bool(ch.wait(c, bool))
            except ServerTimeoutError:
                ob = Obligation(f"store {rid}: {len(commits) - i} commit_store(s) answered "
                                "late, then end its session",
                                time.monotonic() + s.write_ttl_s + LATE_MARGIN_S,
                                pins_writer=pins_writer)
                ob.settler = self._late_commits(ob, ch, commits[i:], rid)
                s.late.adopt(ch, ob)
                return False
            except KVCacheSDKError as err:
                ok = False
                logger.warning("commit_store failed: %s", err)
        # commit_store (affinity pool) touches the session: end it afterwards
        s.end_session(ch, rid)
        return ok

    def _late_commits(self, ob: Obligation, ch: Channel, commits: list[PendingCall],
                      rid: str) -> Settler:
        for c in commits:
            try:
                yield c, bool
            except ProtocolError:
                pass
        ob.pins_writer = False  # the server processed them: nothing pending
        self._s.end_session(ch, rid)

    def _late_prepare(self, ch: Channel, src: torch.Tensor | RowSource, n: int,
                      keys: list[CacheKey], rid: str, calls: list[PendingCall],
                      resps: list[PrepareStoreResponse | None],
                      same_key: tuple[str, int, int]) -> None:
        """Retire ``ch``: fill a late reservation from a snapshot of ``src`` and commit it.

        The snapshot (a clone of the chunks given, taken now, before ``store()`` returns
        to the caller who may then change ``src``) is only taken within the context's
        budget; without it the late reservation is left unfilled, never committed, and
        the writer pinned (never unregistered), so it is never admitted.
        """
        s = self._s
        end = n * s.chunk_size
        nbytes = src.narrow(2, 0, end).nbytes if isinstance(src, torch.Tensor) else src.nbytes
        # Created first: a reply arriving while the KV is cloned counts from now.
        ob = Obligation(f"store {rid} of {n} chunks: prepare_store answered late",
                        time.monotonic() + s.write_ttl_s + LATE_MARGIN_S, key=same_key,
                        pins_writer=True)
        snap = None
        if s.late.take_snapshot_budget(nbytes):
            snap = src.narrow(2, 0, end).clone() if isinstance(src, torch.Tensor) else \
                src.materialize()
        if snap is not None:
            ob.snapshot_bytes = nbytes
        else:
            ob.what += " (no snapshot: over budget)"
        ob.settler = self._late_store(ob, ch, snap, n, keys, rid, calls, list(resps))
        s.late.adopt(ch, ob)

    def _late_store(self, ob: Obligation, ch: Channel, snap: torch.Tensor | None, n: int,
                    keys: list[CacheKey], rid: str, calls: list[PendingCall],
                    resps: list[PrepareStoreResponse | None]) -> Settler:
        """Settle a store whose ``prepare_store`` timed out (see :meth:`_late_prepare`)."""
        s = self._s
        # When each shard's reservation was made, at the earliest: a reply the flow got in
        # time may be much older than the late ones (the server froze in between).
        reserved_after = [c.sent_at for c in calls]
        try:
            for r, c in enumerate(calls):
                if resps[r] is None:
                    resps[r] = yield c, PrepareStoreResponse
                    reserved_after[r] = ob.reply_at
            plans = self._plans(resps, n)
            todo = [p for p in plans if p.idx]
            if not todo:  # nothing was reserved (cached, staged elsewhere, or L1 full)
                ob.pins_writer = False
            elif snap is None:
                logger.warning("store %s: a late reservation of %d chunks stays unfilled "
                               "(no snapshot of the KV: over the %d-byte budget); it is "
                               "never committed nor admitted", rid, len(todo[0].idx),
                               SNAPSHOT_BUDGET_BYTES)
                ob.abandoned_reservation = True
            else:
                oldest = min(reserved_after[p.rank] for p in todo)
                self._check_age(oldest)

                def untimed(fn: Any, t: torch.Tensor, ids: Sequence[int],
                            regions: Sequence[Region], col: int) -> None:
                    fn(t, s.geom, ids, regions, col)  # no caller's OpTiming to add to

                for p in todo:
                    self._scatter(snap, p, untimed)
                self._check_age(oldest)
                commits = [ch.send(Op.COMMIT_STORE, [keys[p.rank], s.writer_id],
                                   raw=[codec.encode(b"")]) for p in todo]
                for c in commits:
                    try:
                        yield c, bool
                    except ProtocolError:
                        pass
                ob.pins_writer = False
                logger.info("store %s: late reservation of %d chunk(s) filled with the "
                            "given KV and committed", rid, n)
        except KVCacheSDKError as err:  # bad reply, too old, pool write failed: pinned
            logger.warning("store %s: late reservation left unfilled: %s", rid, err)
            ob.abandoned_reservation = True
        s.end_session(ch, rid)

    def _store_inline(self, ch: Channel, src: torch.Tensor, toks: list[int], salt: str,
                      n: int) -> StoreResult:
        """Store without SHM: the chunks travel in the ``commit_store`` frames.

        The frame builder (:meth:`_frame_builder`) checks what the server checks (count,
        dtype, shape, byte length, its limits) before a byte is copied: a 0.5.7 server
        answers a mismatch with silence.
        """
        s = self._s
        c = s.chunk_size
        k0 = lookup_release(s, ch, toks, salt)
        if k0 >= n:
            return StoreResult(n * c, n, 0, n, 0)
        rid = s.rid("s")
        commits: list[PendingCall] = []
        builder = self._frame_builder()
        frames: list[bytearray] = []  # kept alive until the replies came (zero-copy sends)
        ok = True
        answered = 0
        try:
            for r in range(s.world_size):
                key = s.key(toks, k0 * c, n * c, rid, salt, r)
                backing, frame, offsets = builder.build(n - k0)
                flat = torch.frombuffer(frame, dtype=torch.uint8)
                base = flat.data_ptr()
                regions = [Region(base + o, builder.nbytes, flat[o:o + builder.nbytes])
                           for o in offsets]
                s.copy(s.backend.scatter, src, range(k0, n), regions, s.shard_cols[r])
                s.tls.chunks = n - k0
                frames.append(backing)
                commits.append(ch.send(Op.COMMIT_STORE, [key, s.writer_id], raw=[frame]))
        finally:
            for i, cm in enumerate(commits):
                try:
                    ok &= bool(ch.wait(cm, bool))
                    answered += 1
                except ServerTimeoutError:  # may still run: wait for it, then end
                    ok = False
                    ob = Obligation(f"store {rid}: inline commit_store answered late, then "
                                    "end its session",
                                    time.monotonic() + s.write_ttl_s + LATE_MARGIN_S)
                    ob.settler = self._late_commits(ob, ch, commits[i:], rid)
                    s.late.adopt(ch, ob)
                    logger.warning("commit_store of %s got no reply in time; verifying by "
                                   "lookup", rid)
                    break
                except KVCacheSDKError as err:
                    ok = False
                    logger.warning("commit_store failed: %s", err)
            if answered == len(commits) == len(frames):
                for b in frames:  # the server has read them (zero-copy sends): reuse
                    builder.release(b)
            if not ch.retired:
                s.end_session(ch, rid)
        k1 = self._settled_prefix(self._after(ch), toks, salt, n)
        present = min(k1, n)
        written = max(0, present - k0)
        if not ok:
            logger.warning("inline commit_store reported a partial write; verified by lookup")
        return StoreResult(present * c, n, written, min(k0, present), n - present)

    def _settled_prefix(self, ch: Channel, toks: list[int], salt: str, n: int) -> int:
        """Cached prefix (chunks) after a store that did not write every chunk itself.

        A chunk that got no slot is cached, refused (L1 full) or being written right now by
        another client (staged, invisible until its commit): look again briefly so a
        concurrent identical store is reported as cached, not refused.
        """
        k = lookup_release(self._s, ch, toks, salt)
        for delay in SETTLE_DELAYS_S:
            if k >= n:
                break
            time.sleep(delay)
            k = lookup_release(self._s, ch, toks, salt)
        return k

    def _frame_builder(self) -> ChunkFrameBuilder | EnvelopeFrameBuilder:
        """The session's frame builder: a msgpack envelope from 0.5.7, a pickle before."""
        b = self._builder
        if b is None:
            s = self._s
            kind = EnvelopeFrameBuilder if s.generation.inline_envelope else ChunkFrameBuilder
            b = self._builder = kind(s.object_shape, s.dtype)
        return b
