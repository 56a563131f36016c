"""Store: write a KV tensor under its token ids, and say what happened to every chunk.

SHM plane: ``prepare_store`` (one per shard) → scatter into the reserved slots →
``commit_store`` (awaited: ``store()`` promises the chunks are visible when it returns) →
``end_session``. Pickle plane: a lookup skips the cached prefix, then one ``commit_store``
per shard carries the pickled chunks. When some chunk got no slot, lookups tell "already
cached" (or being written by another client) from "L1 full" (doc §11 #10).
"""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast.client.lookup import lookup_release
from lmcache_kv_fast.client.read_hints import ReadHints
from lmcache_kv_fast.copy import Region
from lmcache_kv_fast.dataplane.pickle_fast import ChunkFrameBuilder
from lmcache_kv_fast.errors import KVCacheSDKError, ProtocolError
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import PrepareStoreResponse
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall

if TYPE_CHECKING:
    from lmcache_kv_fast.client.session import Session

logger = logging.getLogger(__name__)

#: Re-lookups after a store whose chunks were staged by another writer (seconds apart).
SETTLE_DELAYS_S = (0.005, 0.02, 0.05)


class StoreFlow:
    """The store of one session.

    Args:
        session: The session it runs on.
        hints: The session's read hints (a store that wrote every chunk records its slots).
    """

    def __init__(self, session: Session, hints: ReadHints) -> None:
        self._s = session
        self._hints = hints
        self._builder: ChunkFrameBuilder | None = None

    def store(self, src: torch.Tensor, toks: list[int], salt: str, n: int,
              rc: dict[str, Any] | None, t0: float) -> StoreResult:
        """Store the ``n`` whole chunks of a validated ``[P, L, T, D]`` ``src``."""
        s = self._s
        with s.op(rc, name="store", t0=t0) as ch, s.same_key(salt, toks) as key:
            if s.shm is not None:
                return self._store_shm(ch, src, toks, salt, n, key)
            return self._store_pickle(ch, src, toks, salt, n)

    def _store_shm(self, ch: Channel, src: torch.Tensor, toks: list[int], salt: str,
                   n: int, same_key: tuple[str, int, int]) -> StoreResult:
        s = self._s
        shm = s.shm
        assert shm is not None
        rid = s.rid("s")
        end = n * s.chunk_size
        ws = s.world_size
        keys = [s.key(toks, 0, end, rid, salt, r) for r in range(ws)]
        calls = [ch.send(Op.PREPARE_STORE, [keys[r], s.instance_id]) for r in range(ws)]
        written = [set() for _ in range(ws)]
        commits: list[PendingCall] = []
        try:
            resps: list[PrepareStoreResponse | None] = []
            for c in calls:
                try:
                    resps.append(ch.wait(c, PrepareStoreResponse))
                except BaseException:
                    # A reservation may exist server-side: never unregister over it.
                    s.uncommitted += 1
                    for c2 in calls:
                        ch.discard(c2)
                    raise
            plans = []
            for r, resp in enumerate(resps):
                assert resp is not None
                ctxt = resp.context
                idx = ctxt.chunk_indices
                if len(idx) != len(ctxt.slots) or len(set(idx)) != len(idx) or \
                        any(not 0 <= i < n for i in idx):
                    s.uncommitted += 1
                    raise ProtocolError(
                        f"prepare_store: chunk_indices {idx[:8]} do not match {len(ctxt.slots)} "
                        f"slots of a {n}-chunk store"
                    )
                try:
                    regions = shm.regions(ctxt.slots, s.geom, s.layout.dtype_str,
                                          "prepare_store")
                except ProtocolError:
                    s.uncommitted += 1
                    raise
                plans.append((r, idx, regions, ctxt.slots))
            for r, idx, regions, _ in plans:
                if idx:
                    try:
                        s.copy(s.backend.scatter, src, idx, regions, s.shard_cols[r])
                        s.tls.chunks = max(s.tls.chunks, len(idx))
                    except OSError as err:  # pwritev into the pool file (native backend)
                        s.uncommitted += 1
                        raise KVCacheSDKError(
                            f"cannot write {len(idx)} chunks into the server's SHM pool "
                            f"/dev/shm/{shm.name}: {err}"
                            + (" (the file system holding /dev/shm is full)"
                               if err.errno == errno.ENOSPC else "")
                        ) from err
            for r, idx, _, _ in plans:
                if idx:
                    commits.append(ch.send(Op.COMMIT_STORE, [keys[r], s.instance_id],
                                           raw=[codec.encode(b"")]))
                    written[r] = set(idx)
        finally:
            ok_commits = True
            for c in commits:
                try:
                    ok_commits &= bool(ch.wait(c, bool))
                except KVCacheSDKError as err:
                    ok_commits = False
                    logger.warning("commit_store failed: %s", err)
            # commit_store (affinity pool) touches the session: end it afterwards
            s.end_session(ch, rid)
        all_written = set(range(n))
        for w in written:
            all_written &= w
        if ok_commits and len(all_written) == n:
            hint_key = self._hints.key(same_key)
            if hint_key is not None:  # a retrieve of this prefix may read these slots early
                for r, idx, _, slots in plans:
                    by_chunk = sorted(zip(idx, range(len(idx)), strict=True))
                    self._hints.remember((*hint_key, r), [slots[j] for _, j in by_chunk])
            return StoreResult(end, n, n, 0, 0)
        k = self._settled_prefix(ch, toks, salt, n)
        n_written = len([i for i in all_written if i < k]) if ok_commits else 0
        present = min(k, n)
        cached = max(0, present - n_written)
        return StoreResult(present * s.chunk_size, n, n_written, cached, n - present)

    def _store_pickle(self, ch: Channel, src: torch.Tensor, toks: list[int], salt: str,
                      n: int) -> StoreResult:
        s = self._s
        c = s.chunk_size
        k0 = lookup_release(s, ch, toks, salt)
        if k0 >= n:
            return StoreResult(n * c, n, 0, n, 0)
        rid = s.rid("s")
        commits: list[PendingCall] = []
        builder = self._frame_builder()
        frames: list[bytearray] = []  # kept alive until the replies came (zero-copy sends)
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
                commits.append(ch.send(Op.COMMIT_STORE, [key, s.instance_id], raw=[frame]))
        finally:
            ok = True
            answered = 0
            for cm in commits:
                try:
                    ok &= bool(ch.wait(cm, bool))
                    answered += 1
                except KVCacheSDKError as err:
                    ok = False
                    logger.warning("commit_store failed: %s", err)
            if answered == len(commits) == len(frames):
                for b in frames:  # the server has read them (zero-copy sends): reuse
                    builder.release(b)
            s.end_session(ch, rid)
        k1 = self._settled_prefix(ch, toks, salt, n)
        present = min(k1, n)
        written = max(0, present - k0)
        if not ok:
            logger.warning("pickle commit_store reported a partial write; verified by lookup")
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

    def _frame_builder(self) -> ChunkFrameBuilder:
        b = self._builder
        if b is None:
            b = self._builder = ChunkFrameBuilder(self._s.object_shape, self._s.dtype)
        return b
