"""Retrieve: read the cached prefix of a token sequence into a tensor.

``lookup`` → ``wait_prefetch_status`` (``client/lookup.py``) → ``prepare_retrieve`` (one
per shard) → gather → ``commit_retrieve`` → ``end_session``. The last two are sent without
waiting for their replies (``transport/releases.py``): the data is in the caller's tensor
once the gather finished. The lookup locks of shards that were not read are released with
``free_lookup_locks`` on every failure path (docs/protocol.md §11 #14). Read hints
(``client/read_hints.py``) may copy the chunks while ``prepare_retrieve`` is answered.

When ``prepare_retrieve`` times out it may still run later and record pending reads, so
nothing is released blindly (a ``free_lookup_locks`` racing a late successful prepare would
release a lock twice, maybe another reader's): the channel is retired with an obligation
(``client/late.py``) that waits for each late reply, then commits a shard that was
prepared or frees the lookup locks of one that was not, and ends the session.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lmcache_kv_fast.client.late import Obligation, Settler
from lmcache_kv_fast.client.lookup import LATE_MARGIN_S, free_locks, lookup_chunks
from lmcache_kv_fast.client.read_hints import ReadHints
from lmcache_kv_fast.copy import Region
from lmcache_kv_fast.dataplane.envelope import locate_tensors
from lmcache_kv_fast.dataplane.pickle_fast import locate_chunks
from lmcache_kv_fast.dataplane.pickle_plane import safe_loads_chunks
from lmcache_kv_fast.errors import ProtocolError, ServerTimeoutError
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import CacheKey, PrepareRetrieveResponse, Slot
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall

if TYPE_CHECKING:
    from lmcache_kv_fast.client.session import Session

_T = TypeVar("_T")


class RetrieveFlow:
    """The retrieve of one session.

    Args:
        session: The session it runs on.
        hints: The session's read hints.
    """

    #: Send a retrieve's commit without waiting for its reply (transport/releases.py).
    #: False restores the awaited flow; only benches/bench_release.py turns it off.
    defer_releases: bool = True

    def __init__(self, session: Session, hints: ReadHints) -> None:
        self._s = session
        self._hints = hints

    def retrieve(self, toks: list[int], salt: str, out: torch.Tensor | None,
                 rc: dict[str, Any] | None, t0: float) -> torch.Tensor | None:
        """Retrieve validated whole-chunk ``toks`` (see ``LMCacheKVCacheContext.retrieve``)."""

        def fetch(ch: Channel, hit: list[int], rid: str, n: int, commits: list[list[Any]],
                  key: tuple[str, int, int]) -> torch.Tensor | None:
            return self._fetch(ch, hit, rid, salt, n, out, commits, key)

        return self.with_prefix(toks, salt, rc, t0, "retrieve", fetch)

    def with_prefix(self, toks: list[int], salt: str, rc: dict[str, Any] | None, t0: float,
                    name: str, body: Callable[..., _T]) -> _T | None:
        """Look up ``toks``' cached prefix and run ``body`` on it; release its reads after.

        ``body(ch, hit_tokens, rid, n, commits, same_key)`` runs under the prefix's key lock
        and appends the ``commit_retrieve`` payloads of the shards it read to ``commits``;
        they are sent (not awaited) when it returns, and the session ends after them.
        None when nothing is cached.
        """
        s = self._s
        with s.op(rc, name=name, t0=t0) as ch:
            rid = s.rid("r")
            commits: list[list[Any]] = []
            try:
                n = lookup_chunks(s, ch, toks, rid, salt)
                if n == 0:
                    return None
                hit_toks = toks[: n * s.chunk_size]
                with s.same_key(salt, hit_toks) as key:
                    try:
                        return body(ch, hit_toks, rid, n, commits, key)
                    finally:
                        if commits and self.defer_releases:  # under the key's lock
                            self._release_reads(commits, rid, key)
                        elif commits:  # awaited (benches/bench_release.py compares)
                            for p in commits:
                                s.wait_quiet(ch, ch.send(Op.COMMIT_RETRIEVE, p))
                            commits.clear()
            finally:
                # commit_retrieve (affinity pool) touches the session: with commits, the
                # session ends once they were acknowledged (DeferredReleases); a timed-out
                # retrieve's session is ended by its late-reply settler
                if not commits and not ch.retired:
                    s.end_session(ch, rid)

    @contextlib.contextmanager
    def reading(self, ch: Channel, toks: list[int], rid: str, salt: str, n: int,
                commits: list[list[Any]], same_key: tuple[str, int, int]
                ) -> Iterator[dict[int, list[Region]] | None]:
        """Read-lock the ``n`` chunks of ``toks`` (SHM plane); yield each shard's regions.

        Yields None when a shard was not prepared (nothing to read). The regions are valid
        until the block ends; then the shards read go into ``commits`` (see
        :meth:`with_prefix`) and the lookup locks of the others are freed.
        """
        s = self._s
        ws = s.world_size
        ranks = [0] if s.layout.planes == 1 else list(range(ws))
        keys = {r: s.key(toks, 0, n * s.chunk_size, rid, salt, r) for r in range(ws)}
        calls = {r: ch.send(Op.PREPARE_RETRIEVE, [keys[r], s.instance_id]) for r in ranks}
        resps = self._prepared(ch, keys, rid, calls, ranks, n, same_key, None)
        try:
            if not all(resps[r].success for r in ranks):
                yield None
            else:
                yield {r: self._regions(resps[r], n, "prepare_retrieve") for r in ranks}
        finally:
            self._settle_shards(ch, keys, resps, commits)

    def _prepared(self, ch: Channel, keys: dict[int, CacheKey], rid: str,
                  calls: dict[int, PendingCall], ranks: list[int], n: int,
                  same_key: tuple[str, int, int], during: Callable[[], None] | None
                  ) -> dict[int, PrepareRetrieveResponse]:
        """Wait for every shard's ``prepare_retrieve`` (``during`` runs meanwhile).

        A timeout retires the channel with the obligation to settle the late replies; any
        other failure discards the calls and frees the lookup locks of every shard.
        """
        s = self._s
        resps: dict[int, PrepareRetrieveResponse] = {}
        try:
            if during is not None:
                during()
            for r in ranks:
                resps[r] = ch.wait(calls[r], PrepareRetrieveResponse)
        except ServerTimeoutError:
            ob = Obligation(f"retrieve {rid}: commit or free the read locks of {n} chunks "
                            "and end its session",
                            time.monotonic() + s.read_ttl_s + LATE_MARGIN_S, key=same_key)
            ob.settler = self._late(ch, keys, rid, calls, resps, ranks)
            s.late.adopt(ch, ob)
            raise
        except BaseException:
            for r in ranks:
                ch.discard(calls[r])
            for r in range(s.world_size):
                free_locks(s, ch, keys[r], r)
            raise
        return resps

    def _settle_shards(self, ch: Channel, keys: dict[int, CacheKey],
                       resps: dict[int, PrepareRetrieveResponse],
                       commits: list[list[Any]]) -> None:
        """Queue the commits of the shards prepared; free the lookup locks of the rest.

        SHM: a commit releases the read lock of each object read; pickle: a no-op.
        """
        s = self._s
        for r in range(s.world_size):
            if r in resps and resps[r].success:
                commits.append([keys[r], s.instance_id])
            else:
                free_locks(s, ch, keys[r], r)

    def _fetch(self, ch: Channel, toks: list[int], rid: str, salt: str, n: int,
               out: torch.Tensor | None, commits: list[list[Any]],
               same_key: tuple[str, int, int]) -> torch.Tensor | None:
        """prepare_retrieve every shard, gather; release locks on every path.

        The ``commit_retrieve`` payloads of the shards read are appended to ``commits``
        (the caller sends them, see :meth:`_release_reads`); the lookup locks of shards not
        read are freed here.
        """
        s = self._s
        hit = n * s.chunk_size
        ws = s.world_size
        ranks = [0] if s.layout.planes == 1 else list(range(ws))
        keys = {r: s.key(toks, 0, hit, rid, salt, r) for r in range(ws)}
        calls = {r: ch.send(Op.PREPARE_RETRIEVE, [keys[r], s.instance_id]) for r in ranks}
        hint_key = self._hints.key(same_key)
        dst: torch.Tensor | None = None
        early: dict[int, tuple[list[Slot], int]] = {}

        def read_early() -> None:  # copy while the server answers (hint checked below)
            nonlocal dst, early
            if hint_key is not None:
                dst, early = self._hints.gather(ch, calls, hint_key, ranks, n, out)

        resps = self._prepared(ch, keys, rid, calls, ranks, n, same_key, read_early)
        ok = all(resps[r].success for r in ranks)
        result: torch.Tensor | None = None
        try:
            if ok:
                if out is not None:
                    dst = out
                elif dst is None:
                    dst = s.alloc_result(hit)
                kept, redone = n, 0
                for r in ranks:
                    slots = resps[r].context.slots
                    todo: Sequence[int] = range(n)
                    if hint_key is not None and slots and not resps[r].data:
                        todo_r, k_ok, k_redo = self._hints.reconcile(hint_key, r, slots, early, n)
                        kept, redone = min(kept, k_ok), max(redone, k_redo)
                        if todo_r is None:  # all read while the reply was on its way;
                            # its slots equal the hint's, validated then: refuse them
                            # still if they no longer fit the mapping (a shrunk segment)
                            assert s.shm is not None
                            s.shm.check_mapped(slots, s.geom, "prepare_retrieve")
                            continue
                        todo = todo_r
                    else:
                        kept = 0
                    regions = self._regions(resps[r], n, "prepare_retrieve")
                    s.copy(s.backend.gather, dst, todo, [regions[i] for i in todo],
                           s.shard_cols[r])
                s.tls.chunks = n
                s.tls.hinted, s.tls.rehinted = kept, redone
                result = dst if out is None else out.narrow(-2, 0, hit)
        finally:
            self._settle_shards(ch, keys, resps, commits)
        return result

    def _late(self, ch: Channel, keys: dict[int, CacheKey], rid: str,
              calls: dict[int, PendingCall], resps: dict[int, PrepareRetrieveResponse],
              ranks: list[int]) -> Settler:
        """Settle a retrieve whose ``prepare_retrieve`` timed out (see the module doc)."""
        s = self._s
        got: dict[int, PrepareRetrieveResponse | None] = dict(resps)
        for r in ranks:
            if r not in got:
                try:
                    got[r] = yield calls[r], PrepareRetrieveResponse
                except ProtocolError:
                    got[r] = None
        for r in range(s.world_size):
            resp = got.get(r)
            if resp is not None and resp.success:  # pending reads: commit releases them
                yield ch.send(Op.COMMIT_RETRIEVE, [keys[r], s.instance_id]), None
            else:  # not prepared: the lookup's locks of that shard (worker_id r)
                yield ch.send(Op.FREE_LOOKUP_LOCKS, [keys[r], s.world_size]), None
        s.end_session(ch, rid)

    def _release_reads(self, commits: list[list[Any]], rid: str, same_key: Hashable) -> None:
        """Send the commits of a retrieve without waiting; its session ends after them."""
        self._s.deferred_releases().commit(commits, rid, same_key)

    def _regions(self, resp: PrepareRetrieveResponse, n: int, what: str) -> list[Region]:
        """Where the ``n`` chunks of a reply lie: SHM slots, or spans of its inline data.

        The inline data is a msgpack ``TensorEnvelope`` from 0.5.7 (read strictly: the
        registered count, dtype and shape, or a ``ProtocolError``), a pickle before.
        """
        s = self._s
        geom = s.geom
        if s.shm is not None and not resp.data:
            slots = resp.context.slots
            if len(slots) != n:
                raise ProtocolError(f"{what}: {len(slots)} slots for {n} chunks")
            return s.shm.regions(slots, geom, s.layout.dtype_str, what)
        if not resp.data:
            raise ProtocolError(f"{what}: a hit with neither slots nor data")
        numel = geom.chunk_nbytes // geom.itemsize
        if s.generation.inline_envelope:
            spans: list[tuple[int, int]] | None = locate_tensors(
                resp.data, n, s.object_shape, s.dtype, what)
        else:
            spans = locate_chunks(resp.data, n, numel, s.dtype, what, geom.object_shape())
        if spans is not None:  # zero-copy: read the chunk bytes where they lie in the frame
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read
                flat = torch.frombuffer(resp.data, dtype=torch.uint8)
            base = flat.data_ptr()
            isz = geom.itemsize
            if s.backend.NAME == "torch" and any((base + off) % isz for off, _ in spans):
                # torch cannot view misaligned bytes as the dtype: one aligned copy each
                return [Region.of_tensor(flat[off:off + ln].clone()) for off, ln in spans]
            return [Region(base + off, ln, flat[off:off + ln]) for off, ln in spans]
        chunks = safe_loads_chunks(resp.data, n, numel, s.dtype, what, geom.object_shape())
        return [Region.of_tensor(t) for t in chunks]
