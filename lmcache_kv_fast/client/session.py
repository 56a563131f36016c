"""One registered SDK instance on one server: the state every flow shares.

A :class:`Session` holds what the handshake found (``client/handshake.py``), the
connections (ZMQ channels, the SHM plane), and the rules every operation follows:

* :meth:`Session.op` guards one operation: refuses a closed or forgotten context, runs it
  on the calling thread's channel, turns a timeout into "reconnect" when the server
  forgot this instance, and records its :class:`~lmcache_kv_fast.results.OpTiming`.
* :meth:`Session.same_key` serialises identical operations of this instance (the server
  keys pending transfers by instance and key, ignoring the request id).
* :meth:`Session.close` drains running operations, settles fired releases and the
  obligations of timed-out operations (``client/late.py``), unregisters and unmaps.

Two registrations per context (docs/protocol.md §3.11, ``docs/guarantees.md``): ``instance_id`` (the
*reader*: lookups and retrieves; pinged at connect and by the heartbeat, so a dead client's
read locks are reaped after the reap timeout) and ``writer_id`` (the *writer*: only
``prepare_store`` / ``commit_store``; never pinged, kept alive by re-registering it, so the
server reaps a dead client's writer only after its registration grace, when the write TTL
of any unfilled reservation has expired and the reap cannot admit it). The writer is only
unregistered when no reservation of it can be pending. On the pickle plane (no
reservations outlive a call) both are the same registration.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast.client.engine_kv import EngineKVCopy
from lmcache_kv_fast.client.engine_kv import active as engine_active
from lmcache_kv_fast.client.handshake import CONNECT_PROBE_TIMEOUT_S
from lmcache_kv_fast.client.instances import new_instance_id, release_instance_id
from lmcache_kv_fast.client.late import SETTLE_LATE_S, LateReplies
from lmcache_kv_fast.client.liveness import Background
from lmcache_kv_fast.copy import ChunkGeometry, Region, backend
from lmcache_kv_fast.dataplane.shm import ShmPlane
from lmcache_kv_fast.errors import ContextClosedError, KVCacheSDKError, ServerTimeoutError
from lmcache_kv_fast.layout import CpuEngineKV, KVLayout
from lmcache_kv_fast.protocol.constants import SDK_NUM_KV_READERS
from lmcache_kv_fast.protocol.keys import make_key
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.protocol.types import (
    CacheKey,
    RegisterEngineDrivenContextPayload,
)
from lmcache_kv_fast.results import OpTiming
from lmcache_kv_fast.transport.api_key import ApiKey
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.releases import DeferredReleases
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall, ZmqClient

if TYPE_CHECKING:
    from lmcache_kv_fast.transport.grpc_client import GrpcClient

logger = logging.getLogger(__name__)

#: After a timeout, ``/status`` is asked (this fast) whether the server forgot us.
RESTART_PROBE_TIMEOUT_S = 1.0
#: close() waits at most this long for acknowledgements of fired releases.
SETTLE_ACKS_TIMEOUT_S = 1.0
#: ... and for late replies from a server that forgot this client (restart, reap).
SETTLE_FORGOTTEN_S = 1.0


#: Every session of this process (the at-fork hook marks them foreign in a child).
_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


def _mark_foreign_in_child() -> None:
    """After ``fork()``, in the child: every inherited session belongs to the parent.

    Only a flag is set (no ZMQ call: the inherited sockets and threads are the parent's);
    ``close()`` and the garbage collector then leave them alone.
    """
    for s in list(_LIVE):
        s.foreign = True


os.register_at_fork(after_in_child=_mark_foreign_in_child)


class Session:
    """State and rules shared by a context's flows (lookup, retrieve, store).

    Args:
        url: ZMQ URL of the server (validated).
        http_url: HTTP URL of the server without a trailing slash (validated).
        model_name: Model name the KV is stored under.
        timeout: Seconds every server call may take.
    """

    # Filled by client.handshake.handshake():
    generation: Generation
    server_version: str
    transport: str
    layout: KVLayout
    world_size: int
    #: Tokens per chunk of the server.
    chunk_size: int
    #: The server's normal pool has one thread: requests run in the order they were sent.
    fifo_normal_pool: bool
    align: int
    geom: ChunkGeometry
    #: Column offset of every shard's slice of the hidden dimension.
    shard_cols: list[int]
    dtype: torch.dtype
    #: Shape of the engine-driven object the server allocates per chunk (docs/protocol.md §3.1).
    object_shape: tuple[int, ...]
    #: The server's liveness and TTL settings (``/config``; defaults when absent), in s.
    reap_timeout_s: float = 120.0
    registration_grace_s: float = 3600.0
    write_ttl_s: float = 600.0
    read_ttl_s: float = 300.0
    #: The writer's registration payload (re-sent to keep it alive, see liveness.py).
    writer_payload: RegisterEngineDrivenContextPayload | None = None
    #: A CPU engine's raw rows <-> per-token K/V (set by the handshake through
    #: client/engine_kv.py); None: the objects are what the caller reads and writes.
    engine_kv: CpuEngineKV | None = None
    #: The per-token layout of a CPU engine's model (with ``engine_kv``).
    token_layout: KVLayout | None = None
    _engine_copy: EngineKVCopy | None = None
    #: The server's API key (hidden in every repr), or None.
    api_key: ApiKey | None = None

    def __init__(self, url: str, http_url: str, model_name: str, timeout: float) -> None:
        #: The process that created the session; its sockets, threads and registration
        #: are of no use in another one (after fork()).
        self.pid = os.getpid()
        #: Set in a forked child (at-fork hook): this session is the parent's.
        self.foreign = False
        _LIVE.add(self)
        self.closed = False
        self.closing = False
        #: Set once the server is known to have forgotten this instance (restart / reap).
        self.forgotten: str | None = None
        self.peer_lost = False
        #: The control-plane client, ZMQ or gRPC (``transport.open_control``).
        self.zmq: ZmqClient | GrpcClient | None = None
        self.shm: ShmPlane | None = None
        self.registered = False
        #: The writer registration exists apart from the reader's (SHM plane).
        self.writer_registered = False
        #: close() left the writer registered (a reservation may be pending): its id stays
        #: among this process's own (client/instances.py) for the process's lifetime.
        self.writer_kept = False
        #: Failed stores that may have left a reservation on the server (never unregister
        #: the writer then; see also ``late.pins_writer()``).
        self.uncommitted = 0
        self._ops = 0
        self._ops_cv = threading.Condition()
        #: Retrieve commits sent without waiting (created on the first retrieve).
        self.releases: DeferredReleases | None = None
        self._rid_counter = itertools.count()
        #: Per calling thread: the call's request_configs and its OpTiming counters.
        self.tls = threading.local()
        self._key_locks: dict[tuple[str, int, int], list[Any]] = {}
        self._key_locks_mutex = threading.Lock()
        self.url = url
        self.http_url = http_url
        self.model_name = model_name
        self.timeout = timeout
        self.instance_id = new_instance_id()  # client/instances.py: this process's own ids
        #: Registration used by stores only (== instance_id on the pickle plane).
        self.writer_id = new_instance_id()
        self.background = Background(self)
        #: Obligations of timed-out operations, settled on retired channels.
        self.late = LateReplies(self.background.kick)
        self.backend: ModuleType = backend()

    def setup_geometry(self) -> None:
        """Derive the chunk geometry of one shard from ``layout`` and ``world_size``."""
        lay, ws = self.layout, self.world_size
        if lay.planes == 1:
            width, self.shard_cols = lay.hidden_size, [0] * ws
        else:
            width = lay.shard_hidden(ws)
            self.shard_cols = [r * width for r in range(ws)]
        self.dtype = lay.dtype
        self.geom = ChunkGeometry(
            planes=lay.planes, layers=lay.num_layers, chunk_tokens=self.chunk_size,
            width=width, itemsize=lay.itemsize,
        )
        # The engine-driven object the server allocates: [2, L, C, W] or [L, C, W] (docs/protocol.md §3.1).
        shape = self.geom.object_shape()
        self.object_shape = shape if lay.planes == 2 else shape[1:]

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the KV tensor of ``tokens`` tokens: ``[2, L, T, D]`` or ``[L, T, D]``."""
        lay = self.layout
        if lay.planes == 1:
            return (lay.num_layers, tokens, lay.hidden_size)
        return (2, lay.num_layers, tokens, lay.hidden_size)

    def engine_copy(self) -> EngineKVCopy | None:
        """The per-token chunk converter of a CPU engine's KV (None without ``engine_kv``)."""
        if self.engine_kv is None:
            return None
        if self._engine_copy is None:
            self._engine_copy = EngineKVCopy(self.engine_kv, self.geom, self.backend.gather)
        return self._engine_copy

    # ------------------------------------------------------------------ one operation
    def in_other_process(self) -> bool:
        """Whether this runs in a process other than the creating one (after fork())."""
        return self.foreign or self.pid != os.getpid()

    def check_process(self) -> None:
        """Refuse use in a process other than the creating one (a child after fork()).

        Raises:
            KVCacheSDKError: Called in another process; the child must ``connect()`` its
                own context (ZMQ sockets and threads do not survive a fork).
        """
        if self.in_other_process():
            raise KVCacheSDKError(
                f"this SDK context (model {self.model_name!r} at {self.url}) was created in "
                f"process {self.pid} and cannot be used in process {os.getpid()} (after "
                "fork()): its sockets and threads stay in the parent; connect() a new "
                "context in the child"
            )

    @contextlib.contextmanager
    def op(self, request_configs: dict[str, Any] | None = None, *, name: str = "",
           t0: float = 0.0) -> Iterator[Channel]:
        """Run one operation on the calling thread's channel.

        With ``name``, the call's :class:`OpTiming` (from ``t0``, its start) is recorded.
        """
        self.check_process()
        with self._ops_cv:
            if self.closing or self.closed:
                raise ContextClosedError(
                    f"the SDK context for {self.model_name!r} at {self.url} is closed"
                )
            self._ops += 1
        self.tls.request_configs = request_configs
        try:
            assert self.zmq is not None
            if self.forgotten is not None:
                raise KVCacheSDKError(self.forgotten)
            ch = self.zmq.channel()
            ch.unresponsive = False  # every operation starts with the full timeout
            if ch.peer_lost() or self.peer_lost:
                self.check_registration()
            w0, n0 = ch.wait_s, ch.waits
            tls = self.tls
            tls.copy_s, tls.alloc_s, tls.chunks = 0.0, 0.0, 0
            tls.hinted = tls.rehinted = 0
            try:
                yield ch
            except ServerTimeoutError as err:
                better = self._explain_timeout(err)
                if better is None:
                    raise
                raise better from err
            finally:
                if name:
                    tls.timing = OpTiming(name, time.perf_counter() - t0, ch.wait_s - w0,
                                          tls.copy_s, tls.alloc_s, ch.waits - n0, tls.chunks,
                                          tls.hinted, tls.rehinted)
        finally:
            self.tls.request_configs = None
            with self._ops_cv:
                self._ops -= 1
                self._ops_cv.notify_all()

    def check_registration(self) -> None:
        """After a dropped connection: fail now if the server no longer knows us.

        Raises:
            KVCacheSDKError: The server restarted or reaped this instance (reconnect).
        """
        try:
            st = HttpInfoClient(self.http_url, RESTART_PROBE_TIMEOUT_S, self.api_key).status()
        except KVCacheSDKError:
            self.peer_lost = True  # still down: check again on the next operation
            return
        self.peer_lost = False
        regs = st.get("non_cuda_context_meta")
        if not isinstance(regs, dict):
            return
        gone = [i for i in {self.instance_id, self.writer_id} if str(i) not in regs]
        if gone:
            self.forgotten = (
                f"the LMCache server at {self.url} no longer knows this client (instance "
                f"{gone[0]} is not registered: the server restarted or reaped it); "
                "this context cannot be used any more: close it and reconnect with connect()"
            )
            # What the server held for us died with the registration (or the restart).
            self.late.void("the server forgot this client")
            raise KVCacheSDKError(self.forgotten)

    def _explain_timeout(self, err: ServerTimeoutError) -> ServerTimeoutError | None:
        """Explain a timeout when the server forgot this instance (restart or reap).

        If ``/status`` answers without this instance's registration, later operations
        fail fast with the same reconnect message; otherwise the timeout stands (None).
        """
        try:
            self.check_registration()
        except KVCacheSDKError:
            return ServerTimeoutError(f"{self.forgotten}. ({err})")
        return None

    @contextlib.contextmanager
    def same_key(self, salt: str, toks: list[int]) -> Iterator[tuple[str, int, int]]:
        """Serialize prepare→commit of identical keys within this instance; yield the key.

        The server keys pending transfers by ``(instance_id, key)`` ignoring the request id
        (docs/protocol.md §3.4): two concurrent identical operations of one instance would overwrite each
        other's pending entry and leak read locks or staged slots. Different keys never wait.
        A retrieve's commit is not awaited (DeferredReleases): an identical operation
        waits for its acknowledgement here, under the key's lock.

        The key is ``(salt, len(toks), hash(tuple(toks)))``, hashed once (a long token tuple
        is slow to hash, and the key is looked up several times): a collision could
        only make two different operations wait for each other. It is also the key of the
        prefix's read hints.
        """
        k = (salt, len(toks), hash(tuple(toks)))
        with self._key_locks_mutex:
            entry = self._key_locks.get(k)
            if entry is None:
                entry = self._key_locks[k] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                rel = self.releases
                if rel is not None and rel.busy(k):
                    rel.wait_key(k, self.timeout)
                if self.late.busy(k) and not self.late.wait_key(k, self.timeout):
                    raise ServerTimeoutError(
                        f"an identical earlier operation on {self.url} timed out and its "
                        f"late reply was not settled within {self.timeout:g}s"
                    )
                yield k
        finally:
            with self._key_locks_mutex:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._key_locks[k]

    # ------------------------------------------------------------------ requests
    def rid(self, kind: str) -> str:
        """A fresh request id of this instance (``kind``: l, r or s)."""
        return f"kvf-{kind}-{self.instance_id:x}-{next(self._rid_counter)}"

    def key(self, tokens: list[int], start: int, end: int, rid: str, salt: str,
            worker_id: int | None) -> CacheKey:
        """The wire key of ``tokens[start:end]`` with the calling thread's request_configs."""
        return make_key(
            self.generation, model_name=self.model_name, world_size=self.world_size,
            worker_id=worker_id, tokens=tokens, start=start, end=end, request_id=rid,
            cache_salt=salt, request_configs=getattr(self.tls, "request_configs", None),
            num_kv_readers=SDK_NUM_KV_READERS,
        )

    def copy(self, fn: Any, t: torch.Tensor, chunk_ids: Sequence[int],
             regions: Sequence[Region], col_offset: int) -> None:
        """Run a backend scatter / gather, adding its time to this call's OpTiming."""
        t0 = time.perf_counter()
        try:
            conv = engine_active(self)  # a per-token call of a CPU engine's KV
            if conv is None:
                fn(t, self.geom, chunk_ids, regions, col_offset)
            else:
                conv.copy(fn, t, chunk_ids, regions)
        finally:
            self.tls.copy_s += time.perf_counter() - t0

    def alloc_result(self, tokens: int) -> torch.Tensor:
        """Allocate a retrieve's result of ``tokens`` tokens, timed as this call's alloc_s."""
        ta = time.perf_counter()
        conv = engine_active(self)
        shape = self.kv_shape(tokens) if conv is None else conv.kv_shape(tokens)
        dst = self.backend.alloc_result(shape, self.dtype)
        self.tls.alloc_s = time.perf_counter() - ta
        return dst

    def wait_quiet(self, ch: Channel, call: PendingCall) -> None:
        """Wait for a cleanup reply; log instead of raising."""
        try:
            ch.wait(call)
        except KVCacheSDKError as err:
            logger.warning("cleanup call %s failed: %s", call.op.value, err)

    def end_session(self, ch: Channel, rid: str) -> None:
        """End a session without waiting for its acknowledgement.

        Saves a round trip per call; the acknowledgement is collected later, at the latest
        before the socket closes.
        """
        ch.fire(Op.END_SESSION, [rid])

    def deferred_releases(self) -> DeferredReleases:
        """The channel of releases sent without waiting.

        Created on first use, with the background thread that collects their
        acknowledgements.
        """
        rel = self.releases
        if rel is None:
            assert self.zmq is not None
            rel = self.releases = DeferredReleases(self.zmq, self.background.wake)
            self.background.ensure()
        return rel

    # ------------------------------------------------------------------ admin calls
    def clear(self, force: bool) -> None:
        """Clear the server's L1 (see ``LMCacheKVCacheContext.clear``)."""
        gen = self.generation
        if not force and not gen.clear_takes_force:
            logger.debug("LMCache %s has no unforced clear; clearing locked objects too",
                         self.server_version)
        with self.op() as ch:
            if self.releases is not None:  # read locks of finished retrieves: gone first
                self.releases.settle(self.timeout)
            ch.call(Op.CLEAR, [bool(force)] if gen.clear_takes_force else [], None)

    def ping(self) -> bool:
        """Ping the server for this instance; True when it answered."""
        with self.op() as ch:
            return bool(ch.call(Op.PING, [self.instance_id], None,
                                min(self.timeout, CONNECT_PROBE_TIMEOUT_S)))

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Drain running operations (up to ``timeout``), then :meth:`teardown`. Idempotent.

        In a forked child it does nothing: the sockets, threads, mapping and server
        registration are the parent's (which keeps using them).
        """
        if self.in_other_process():
            return
        with self._ops_cv:
            if self.closing or self.closed:
                return
            self.closing = True
            drained = self._ops_cv.wait_for(lambda: self._ops == 0, timeout=self.timeout)
        if not drained:
            logger.warning("close(): operations still running after %gs; stopping them",
                           self.timeout)
        self.teardown(drained)

    def teardown(self, drained: bool = True) -> None:
        """Stop the background thread, settle, unregister, close the sockets and unmap.

        Obligations of timed-out operations are settled first (at most
        ``min(timeout, SETTLE_LATE_S)``). The reader is always unregistered (it never holds
        a reservation); the writer only when no reservation of it can be pending (the
        server would admit its slots as data, docs/protocol.md §3.2): otherwise it stays registered and
        the server reaps it after its registration grace, when the reservation's write TTL
        has expired and the reap cannot admit it. Nothing in a forked child.
        """
        if self.in_other_process():
            return
        self.background.stop()
        zmq_client = self.zmq
        usable = zmq_client is not None and not zmq_client.closing and \
            self.forgotten is None
        if zmq_client is not None and not zmq_client.closing and self.late.pending():
            # A restarted server answers what it still gets of ours (requests queued while
            # it was down) at once, or never: settle briefly then.
            self.late.settle(min(self.timeout, SETTLE_LATE_S if usable else
                                 SETTLE_FORGOTTEN_S))
        if usable and drained and not self.peer_lost:
            # Fired releases (commits, end_session) reach the server before we unregister /
            # close. (A restarted or dead server never acknowledges them: then do not wait.)
            assert zmq_client is not None
            budget = min(self.timeout, SETTLE_ACKS_TIMEOUT_S)
            if self.releases is not None:
                self.releases.settle(budget)
            zmq_client.settle(budget)
        if usable and self.registered:
            assert zmq_client is not None
            self._unregister(zmq_client, drained)
        self.late.close()
        if zmq_client is not None:
            zmq_client.close()
        with self._ops_cv:
            busy = self._ops
        if self.shm is not None:
            if busy and not drained:
                logger.warning("leaving the SHM mapping in place: a copy may still be running")
            else:
                self.shm.close()
        self.closing = True
        self.closed = True
        release_instance_id(self.instance_id)
        if self.writer_id != self.instance_id and not self.writer_kept:
            release_instance_id(self.writer_id)

    def _unregister(self, zmq_client: ZmqClient | GrpcClient, drained: bool) -> None:
        """Unregister the reader, and the writer unless a reservation of it may be pending."""
        probe = min(self.timeout, CONNECT_PROBE_TIMEOUT_S)
        ids = [self.instance_id]
        if self.writer_registered:
            pinned = self.uncommitted or self.late.pins_writer() or not drained
            if pinned:
                self.writer_kept = True
                logger.warning(
                    "not unregistering writer instance %d: a reservation of a failed store "
                    "may still be pending on the server (unregistering would admit its "
                    "unfilled slots as data, docs/protocol.md §3.2). The server reaps it after its "
                    "registration grace (%gs), when the reservation's write TTL (%gs) has "
                    "expired", self.writer_id, self.registration_grace_s, self.write_ttl_s,
                )
            else:
                ids.append(self.writer_id)
        elif self.uncommitted or self.late.pins_writer():  # pickle: one registration
            logger.warning("not unregistering instance %d: a store may be pending",
                           self.instance_id)
            ids = []
        for iid in ids:
            try:
                zmq_client.call(Op.UNREGISTER_ENGINE_DRIVEN, [iid], None, probe)
            except KVCacheSDKError as err:
                logger.warning("unregister on close failed: %s", err)
                break

    def collected(self) -> None:
        """Close the session of a context the garbage collector took (weakref.finalize).

        Does nothing in a forked child (the sockets and registrations are the parent's).
        Closes on a short-lived thread: the collection may run on any thread, even in the
        middle of this session's own background work.
        """
        if self.pid != os.getpid() or self.closed or self.closing:
            return
        if sys.is_finalizing() or not threading.main_thread().is_alive():
            self.close()  # interpreter exit: no new threads; nothing else runs anyway
            return
        logger.info("an unclosed context for %r at %s was garbage-collected: closing it",
                    self.model_name, self.url)
        try:
            threading.Thread(target=self.close, name=f"lmcache-kv-fast-close-"
                             f"{self.instance_id:x}", daemon=True).start()
        except RuntimeError:  # pragma: no cover - interpreter shutting down
            self.close()
