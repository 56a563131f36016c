"""One connected SDK context: the handshake result and the store / retrieve / lookup flows.

Flows (protocol doc §1, §3), every request on the calling thread's own DEALER socket:

* retrieve: ``lookup`` → ``wait_prefetch_status`` → ``prepare_retrieve`` (one per shard) →
  gather → ``commit_retrieve`` → ``end_session``, the last two sent without waiting for
  their replies (``transport/releases.py``). Locks of shards that were not read are
  released with ``free_lookup_locks`` on every failure path (doc §11 #14).
* store: ``prepare_store`` (one per shard) → scatter → ``commit_store`` (+ ``end_session``),
  or on the pickle plane a single ``commit_store`` with the pickled chunks. When some
  chunk got no slot, a lookup tells "already cached" from "L1 full" (doc §11 #10).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import secrets
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

from lmcache_kv_fast.copy import ChunkGeometry, Region, backend
from lmcache_kv_fast.copy.select import usable_cores
from lmcache_kv_fast.dataplane.pickle_fast import ChunkFrameBuilder, locate_chunks
from lmcache_kv_fast.dataplane.pickle_plane import safe_loads_chunks
from lmcache_kv_fast.dataplane.shm import ShmPlane
from lmcache_kv_fast.errors import (
    ContextClosedError,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheSDKError,
    ProtocolError,
    ServerTimeoutError,
)
from lmcache_kv_fast.layout import KVLayout, decode_status_entry, find_model_entries
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.constants import (
    DEFAULT_ALIGN_BYTES,
    INSTANCE_ID_BITS,
    SDK_NUM_KV_READERS,
)
from lmcache_kv_fast.protocol.detect import detect_generation
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.protocol.types import (
    IPCCacheServerKey,
    PrepareRetrieveResponse,
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
    Slot,
)
from lmcache_kv_fast.results import OpTiming, StoreResult
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.releases import DeferredReleases
from lmcache_kv_fast.transport.zmq_client import Channel, PendingCall, ZmqClient
from lmcache_kv_fast.validation import (
    check_connect_args,
    check_kv,
    check_out,
    check_request_configs,
    check_salt,
    normalize_tokens,
)

logger = logging.getLogger(__name__)

#: Re-exported: other modules import these from here.
__all__ = ["LMCacheKVCacheContext", "OpTiming", "StoreResult", "check_request_configs",
           "check_salt", "normalize_tokens", "usable_cores"]

#: connect() probes give up after this long for an unreachable peer.
CONNECT_PROBE_TIMEOUT_S = 5.0
#: After a timeout, ``/status`` is asked (this fast) whether the server forgot us.
RESTART_PROBE_TIMEOUT_S = 1.0
#: Re-lookups after a store whose chunks were staged by another writer (seconds apart).
SETTLE_DELAYS_S = (0.005, 0.02, 0.05)
#: close() waits at most this long for acknowledgements of fired releases.
SETTLE_ACKS_TIMEOUT_S = 1.0
#: The background thread collects deferred release acknowledgements this often.
RELEASE_COLLECT_S = 0.01
#: ... and, with none pending, looks again this often (it is also woken when some come).
RELEASE_IDLE_CHECK_S = 0.5
#: Prefixes whose chunk locations a context remembers for speculative gathers.
SLOT_HINTS_MAX = 256
#: Seconds one ``wait_prefetch_status`` may block the server's normal pool.
PREFETCH_WAIT_SLICE_S = 0.1



class LMCacheKVCacheContext:
    """A connection to one LMCache MP server for one model.

    Create it with :func:`lmcache_kv_fast.connect` (or the constructor); use
    :meth:`retrieve`, :meth:`store`, :meth:`store_ex`, :meth:`lookup`; :meth:`close` it (or
    use it as a context manager). Safe to share between threads.

    Args:
        url: ZMQ URL of the server, ``tcp://host:port``.
        http_url: HTTP URL of the server, ``http://host:port``.
        model_name: Model name the KV is stored under.
        timeout: Seconds every server call may take.
        layout: Explicit model geometry; when None it is read from the vLLM registration
            in ``/status`` (like the upstream SDK).
        world_size: Tensor-parallel KV shards (with ``layout``; else from ``/status``).
        copy_threads: Threads of the native copy pool (None: env or usable cores).
        heartbeat: Ping the server so it never reaps this live client (doc §3.11).
        read_hints: Copy a retrieved prefix from where it lay last time until the server's
            ``prepare_retrieve`` reply is in (SHM only; each chunk kept only when the reply
            names the slot it was read from).

    Raises:
        KVCacheSDKError: The server cannot be used (see the message for why).
    """

    #: Send a retrieve's commit without waiting for its reply (transport/releases.py).
    #: False restores the awaited flow; only benches/bench_release.py turns it off.
    _defer_releases: bool = True

    def __init__(
        self,
        url: str,
        http_url: str,
        model_name: str,
        timeout: float = 60.0,
        *,
        layout: KVLayout | None = None,
        world_size: int | None = None,
        copy_threads: int | None = None,
        heartbeat: bool = True,
        read_hints: bool = True,
    ) -> None:
        self._closed = False
        self._closing = False
        #: Set once the server is known to have forgotten this instance (restart / reap).
        self._forgotten: str | None = None
        self._peer_lost = False
        self._zmq: ZmqClient | None = None
        self._shm: ShmPlane | None = None
        self._builder: ChunkFrameBuilder | None = None
        self._registered = False
        self._uncommitted = 0
        self._ops = 0
        self._ops_cv = threading.Condition()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._hb_interval: float | None = None
        self._bg_wake = threading.Event()
        self._bg_mutex = threading.Lock()
        #: Retrieve commits sent without waiting (created on the first retrieve).
        self._releases: DeferredReleases | None = None
        self._rid_counter = itertools.count()
        self._tls = threading.local()  # per-call request_configs of the calling thread
        self._key_locks: dict[tuple[str, int, int], list[Any]] = {}
        self._key_locks_mutex = threading.Lock()
        #: Where each shard's chunks lay at the last retrieve / full store of a prefix.
        self._read_hints = bool(read_hints)
        self._slot_hints: OrderedDict[tuple[Any, ...], list[Slot]] = OrderedDict()
        self._slot_hints_mutex = threading.Lock()
        check_connect_args(url, http_url, model_name, timeout, world_size, copy_threads)
        self.url = url
        self.http_url = http_url.rstrip("/")
        self.model_name = model_name
        self.timeout = float(timeout)
        self.instance_id = secrets.randbits(INSTANCE_ID_BITS) or 1
        self._backend: ModuleType = backend()
        if copy_threads is not None:
            self._backend.set_threads(copy_threads)
        try:
            self._handshake(layout, world_size)
            if heartbeat:
                self._start_heartbeat()
        except BaseException:
            self._teardown()
            raise

    # ------------------------------------------------------------------ handshake
    def _handshake(self, layout: KVLayout | None, world_size: int | None) -> None:
        probe = min(self.timeout, CONNECT_PROBE_TIMEOUT_S)
        http = HttpInfoClient(self.http_url, probe)
        cfg = http.config()
        mp = cfg["mp"]
        self._chunk_size = _positive_int(mp.get("chunk_size"), "/config mp.chunk_size")
        mode = mp.get("supported_transfer_mode", "auto")
        if mode not in ("auto", "engine_driven"):
            raise KVCacheSDKError(
                f"the server at {self.http_url} runs with --supported-transfer-mode {mode}; "
                "the SDK needs 'auto' or 'engine_driven' (restart the server with "
                "--supported-transfer-mode auto)"
            )
        if mp.get("transport", "zmq") != "zmq":
            raise KVCacheSDKError(
                f"the server at {self.http_url} uses transport {mp.get('transport')!r}; "
                "this SDK speaks the ZMQ transport"
            )
        version = http.version()
        gen, verify = detect_generation(version, mp)
        self.generation: Generation = gen
        self.server_version: str = version.strip('"') if version else f"{gen.name} (detected)"
        workers = mp.get("max_cpu_workers") or mp.get("max_workers") or 1
        self._fifo_normal_pool = workers == 1
        self._align = _align_from_config(cfg)

        self._zmq = ZmqClient(self.url, gen, self.timeout)
        try:
            reply = self._zmq.call(Op.NOOP, (), None, probe)
        except ServerTimeoutError as err:
            raise KVCacheSDKError(
                f"nothing answers noop on {self.url} within {probe:g}s (HTTP at "
                f"{self.http_url} does). Check the ZMQ URL/port, or the server's request "
                "loop is dead (restart it)"
            ) from err
        if reply != "OK":
            raise KVCacheSDKError(
                f"noop on {self.url} answered {reply!r}, expected 'OK': the server speaks "
                f"another dialect than {gen.name}" + (" (newer, unverified)" if verify else "")
            )

        status = http.status()
        entries = find_model_entries(status, self.model_name)
        if layout is not None:
            if not isinstance(layout, KVLayout):
                raise InvalidTypeError(
                    f"layout must be a KVLayout, got {type(layout).__name__}"
                )
            ws = 1 if world_size is None else world_size
            if entries:
                decoded = decode_status_entry(entries[0][1], self._chunk_size)
                decoded.require_single_group()
                theirs = KVLayout.from_decoded(decoded)
                diffs = layout.diff(theirs)
                if diffs or decoded.world_size != ws:
                    if decoded.world_size != ws:
                        diffs.append(f"world_size: given {ws}, vLLM has {decoded.world_size}")
                    raise KVCacheSDKError(
                        f"explicit layout for {self.model_name!r} disagrees with the vLLM "
                        f"registration on the server: {'; '.join(diffs)}"
                    )
        else:
            if not entries:
                known = sorted({e.get("model_name", "?") for e in
                                (status.get("cache_context_meta") or {}).values()
                                if isinstance(e, dict)})
                raise KVCacheSDKError(
                    f"no registered KV layout for model {self.model_name!r} on "
                    f"{self.http_url} (models with a vLLM registration: {known or 'none'}). "
                    "Start vLLM with LMCache for this model first, or pass the geometry "
                    "explicitly: connect(..., layout=KVLayout(...))"
                )
            decoded = decode_status_entry(entries[0][1], self._chunk_size)
            decoded.require_single_group()
            layout = KVLayout.from_decoded(decoded)
            ws = decoded.world_size
            if world_size is not None and world_size != ws:
                raise KVCacheSDKError(
                    f"world_size={world_size} given, but the vLLM registration of "
                    f"{self.model_name!r} has world_size {ws}"
                )
        self.layout: KVLayout = layout
        self.world_size: int = ws
        self._setup_geometry()
        _check_chunk_fits(self._geom.chunk_nbytes, _l1_bytes_from_config(cfg),
                          "the server's L1 (/config size_in_bytes)")

        payload = RegisterEngineDrivenContextPayload(
            instance_id=self.instance_id,
            model_name=self.model_name,
            world_size=ws,
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            hidden_dim_size=self._geom.width,
            dtype_str=layout.dtype_str,
            use_mla=layout.planes == 1,
            num_physical_slots=self._chunk_size,
        )
        try:
            resp = self._zmq.call(Op.REGISTER_ENGINE_DRIVEN, [payload],
                                  RegisterEngineDrivenContextResponse)
        except ServerTimeoutError as err:
            raise KVCacheSDKError(
                f"register_kv_cache_engine_driven_context on {self.url} got no reply: the "
                "server refused the registration (see its log) or engine-driven transfers "
                "are disabled (--supported-transfer-mode auto)"
            ) from err
        self._registered = True
        if resp.shm_name:
            self._shm = ShmPlane(self._backend, resp.shm_name, resp.pool_size, self._align)
            self.transport = "shm"
            _check_chunk_fits(self._geom.chunk_nbytes, resp.pool_size, "the server's SHM pool")
        else:
            self.transport = "pickle"
        logger.info(
            "connected to LMCache %s at %s (model %s, %s plane, chunk %d, world_size %d, "
            "backend %s)", self.server_version, self.url, self.model_name, self.transport,
            self._chunk_size, ws, self._backend.NAME,
        )

    def _setup_geometry(self) -> None:
        lay, ws = self.layout, self.world_size
        if lay.planes == 1:
            width, self._shard_cols = lay.hidden_size, [0] * ws
        else:
            width = lay.shard_hidden(ws)
            self._shard_cols = [r * width for r in range(ws)]
        self._dtype: torch.dtype = lay.dtype
        self._geom = ChunkGeometry(
            planes=lay.planes, layers=lay.num_layers, chunk_tokens=self._chunk_size,
            width=width, itemsize=lay.itemsize,
        )
        # The engine-driven object the server allocates: [2, L, C, W] or [L, C, W] (doc §3.1).
        shape = self._geom.object_shape()
        self._object_shape = shape if lay.planes == 2 else shape[1:]

    # ------------------------------------------------------------------ properties
    @property
    def chunk_size(self) -> int:
        """Tokens per chunk of the server."""
        return self._chunk_size

    @property
    def mq_timeout(self) -> float:
        """Seconds every server call may take (upstream name)."""
        return self.timeout

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed or self._closing

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the KV tensors."""
        return self._dtype

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the KV tensor of ``tokens`` tokens: ``[2, L, T, D]`` or ``[L, T, D]``."""
        lay = self.layout
        if lay.planes == 1:
            return (lay.num_layers, tokens, lay.hidden_size)
        return (2, lay.num_layers, tokens, lay.hidden_size)

    @property
    def last_timing(self) -> OpTiming | None:
        """Phase breakdown of this thread's last ``store`` / ``retrieve`` / ``lookup``.

        None before the first call on this thread. See :class:`OpTiming`.
        """
        return getattr(self._tls, "timing", None)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _op(self, request_configs: dict[str, Any] | None = None, *, name: str = "",
            t0: float = 0.0) -> Iterator[Channel]:
        """Run one operation on the calling thread's channel.

        With ``name``, the call's :class:`OpTiming` (from ``t0``, its start) is recorded.
        """
        with self._ops_cv:
            if self._closing or self._closed:
                raise ContextClosedError(
                    f"the SDK context for {self.model_name!r} at {self.url} is closed"
                )
            self._ops += 1
        self._tls.request_configs = request_configs
        try:
            assert self._zmq is not None
            if self._forgotten is not None:
                raise KVCacheSDKError(self._forgotten)
            ch = self._zmq.channel()
            ch.unresponsive = False  # every operation starts with the full timeout
            if ch.peer_lost() or self._peer_lost:
                self._check_registration()
            w0, n0 = ch.wait_s, ch.waits
            tls = self._tls
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
            self._tls.request_configs = None
            with self._ops_cv:
                self._ops -= 1
                self._ops_cv.notify_all()

    def _check_registration(self) -> None:
        """After a dropped connection: fail now if the server no longer knows us.

        Raises:
            KVCacheSDKError: The server restarted or reaped this instance (reconnect).
        """
        try:
            st = HttpInfoClient(self.http_url, RESTART_PROBE_TIMEOUT_S).status()
        except KVCacheSDKError:
            self._peer_lost = True  # still down: check again on the next operation
            return
        self._peer_lost = False
        regs = st.get("non_cuda_context_meta")
        if isinstance(regs, dict) and str(self.instance_id) not in regs:
            self._forgotten = (
                f"the LMCache server at {self.url} no longer knows this client (instance "
                f"{self.instance_id} is not registered: the server restarted or reaped it); "
                "this context cannot be used any more: close it and reconnect with connect()"
            )
            raise KVCacheSDKError(self._forgotten)

    def _explain_timeout(self, err: ServerTimeoutError) -> ServerTimeoutError | None:
        """Explain a timeout when the server forgot this instance (restart or reap).

        If ``/status`` answers without this instance's registration, later operations
        fail fast with the same reconnect message; otherwise the timeout stands (None).
        """
        try:
            self._check_registration()
        except KVCacheSDKError:
            return ServerTimeoutError(f"{self._forgotten}. ({err})")
        return None

    @contextlib.contextmanager
    def _same_key(self, salt: str, toks: list[int]) -> Iterator[tuple[str, int, int]]:
        """Serialize prepare→commit of identical keys within this instance; yield the key.

        The server keys pending transfers by ``(instance_id, key)`` ignoring the request id
        (doc §3.4): two concurrent identical operations of one instance would overwrite each
        other's pending entry and leak read locks or staged slots. Different keys never wait.
        A retrieve's commit is not awaited (DeferredReleases): an identical operation
        waits for its acknowledgement here, under the key's lock.

        The key is ``(salt, len(toks), hash(tuple(toks)))``, hashed once (a 4096-token tuple
        costs ~50 us per hash, and the key is looked up several times): a collision could
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
                rel = self._releases
                if rel is not None and rel.busy(k):
                    rel.wait_key(k, self.timeout)
                yield k
        finally:
            with self._key_locks_mutex:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._key_locks[k]

    def _rid(self, kind: str) -> str:
        return f"kvf-{kind}-{self.instance_id:x}-{next(self._rid_counter)}"

    def _key(self, tokens: list[int], start: int, end: int, rid: str, salt: str,
             worker_id: int | None) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=self.model_name, world_size=self.world_size, worker_id=worker_id,
            token_ids=tokens, start=start, end=end, request_id=rid, cache_salt=salt,
            request_configs=getattr(self._tls, "request_configs", None),
            num_kv_readers=SDK_NUM_KV_READERS,
        )

    def _copy(self, fn: Any, t: torch.Tensor, chunk_ids: Sequence[int],
              regions: Sequence[Region], col_offset: int) -> None:
        """Run a backend scatter / gather, adding its time to this call's OpTiming."""
        t0 = time.perf_counter()
        try:
            fn(t, self._geom, chunk_ids, regions, col_offset)
        finally:
            self._tls.copy_s += time.perf_counter() - t0

    def _wait_quiet(self, ch: Channel, call: PendingCall) -> None:
        """Wait for a cleanup reply; log instead of raising."""
        try:
            ch.wait(call)
        except KVCacheSDKError as err:
            logger.warning("cleanup call %s failed: %s", call.op.value, err)

    # ------------------------------------------------------------------ lookup
    def _lookup_chunks(self, ch: Channel, tokens: list[int], rid: str, salt: str) -> int:
        """Run lookup + wait; return the number of leading hit chunks (read-locked)."""
        n_chunks = len(tokens) // self._chunk_size
        key = self._key(tokens, 0, n_chunks * self._chunk_size, rid, salt, None)
        c_lookup = ch.send(Op.LOOKUP, [key, self.world_size])
        deadline = time.monotonic() + self.timeout
        c_wait = None
        if self._fifo_normal_pool:  # FIFO pool: the wait runs after the lookup
            c_wait = ch.send(Op.WAIT_PREFETCH_STATUS, [rid, PREFETCH_WAIT_SLICE_S])
        try:
            ch.wait(c_lookup)
        except BaseException:
            if c_wait is not None:
                ch.discard(c_wait)
            raise
        result = None
        while result is None:
            if c_wait is None:
                c_wait = ch.send(Op.WAIT_PREFETCH_STATUS, [rid, PREFETCH_WAIT_SLICE_S])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ch.discard(c_wait)
                self._free_locks(ch, key)
                raise ServerTimeoutError(
                    f"lookup of {len(tokens)} tokens on {self.url} not finished after "
                    f"{self.timeout:g}s"
                )
            result = ch.wait(c_wait, int | None, remaining + PREFETCH_WAIT_SLICE_S)
            c_wait = None
        if not 0 <= result <= n_chunks:
            self._free_locks(ch, key)
            raise ProtocolError(
                f"wait_prefetch_status answered {result} hit chunks for a {n_chunks}-chunk lookup"
            )
        return int(result)

    def _free_locks(self, ch: Channel, key: IPCCacheServerKey,
                    worker_id: int | None = None) -> None:
        """Release a lookup's read locks (call before end_session)."""
        k = IPCCacheServerKey(**{f: getattr(key, f) for f in key.__struct_fields__})
        k.worker_id = worker_id
        self._wait_quiet(ch, ch.send(Op.FREE_LOOKUP_LOCKS, [k, self.world_size]))

    def _end_session(self, ch: Channel, rid: str) -> None:
        """End a session without waiting for its acknowledgement.

        Saves ~0.3-0.5 ms per call; the acknowledgement is collected later, at the latest
        before the socket closes.
        """
        ch.fire(Op.END_SESSION, [rid])

    def lookup(self, tokens: Sequence[int], cache_salt: str = "", *,
               request_configs: dict[str, Any] | None = None) -> int:
        """Return how many leading tokens are cached (whole chunks), moving no data.

        Every lock and session the lookup takes is released before returning.

        Args:
            tokens: Token ids from position 0.
            cache_salt: Per-tenant isolation salt.
            request_configs: Free-form per-request metadata passed through in the keys.

        Returns:
            Cached prefix length in tokens (a multiple of ``chunk_size``).
        """
        t0 = time.perf_counter()
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        n_tok = len(toks) // self._chunk_size * self._chunk_size
        if n_tok == 0:
            return 0
        rc = check_request_configs(request_configs)
        with self._op(rc, name="lookup", t0=t0) as ch:
            return self._lookup_release(ch, toks[:n_tok], salt) * self._chunk_size

    def _lookup_release(self, ch: Channel, toks: list[int], salt: str) -> int:
        rid = self._rid("l")
        hit = 0
        try:
            hit = self._lookup_chunks(ch, toks, rid, salt)
        finally:
            if hit:
                key = self._key(toks, 0, hit * self._chunk_size, rid, salt, None)
                c_free = ch.send(Op.FREE_LOOKUP_LOCKS, [key, self.world_size])
                if self._fifo_normal_pool:  # one FIFO thread: the end runs after the free
                    self._end_session(ch, rid)
                    self._wait_quiet(ch, c_free)
                else:
                    self._wait_quiet(ch, c_free)
                    self._end_session(ch, rid)
            else:
                self._end_session(ch, rid)
        return hit

    # ------------------------------------------------------------------ retrieve
    def retrieve(self, tokens: Sequence[int], cache_salt: str = "", *,
                 out: torch.Tensor | None = None,
                 request_configs: dict[str, Any] | None = None) -> torch.Tensor | None:
        """Retrieve the KV of the cached prefix of ``tokens``.

        Args:
            tokens: Token ids from position 0 (a trailing partial chunk is ignored).
            cache_salt: Per-tenant isolation salt.
            request_configs: Free-form per-request metadata passed through in the keys.
            out: Optional contiguous CPU tensor of the model's dtype, shaped
                ``[2, L, >=T, D]`` (``[L, >=T, D]`` for single-plane models), to write into;
                the result is then ``out[..., :hit, :]``. Its content beyond the hit, on a
                miss or when the call raises is unspecified (read hints may have filled it
                from the prefix's last known chunks; never from unvalidated slots).

        Returns:
            A contiguous ``[2, L, hit, D]`` tensor (``[L, hit, D]`` for single-plane
            models), or None when fewer than one chunk is given or nothing is cached.
        """
        t0 = time.perf_counter()
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        n_tok = len(toks) // self._chunk_size * self._chunk_size
        if out is not None:
            out = check_out(out, n_tok, self.layout, self._dtype)
        if n_tok == 0:
            return None
        toks = toks[:n_tok]
        rc = check_request_configs(request_configs)
        with self._op(rc, name="retrieve", t0=t0) as ch:
            rid = self._rid("r")
            commits: list[list[Any]] = []
            try:
                n = self._lookup_chunks(ch, toks, rid, salt)
                if n == 0:
                    return None
                hit_toks = toks[: n * self._chunk_size]
                with self._same_key(salt, hit_toks) as key:
                    try:
                        return self._fetch(ch, hit_toks, rid, salt, n, out, commits, key)
                    finally:
                        if commits and self._defer_releases:  # under the key's lock
                            self._release_reads(commits, rid, key)
                        elif commits:  # awaited (benches/bench_release.py compares)
                            for p in commits:
                                self._wait_quiet(ch, ch.send(Op.COMMIT_RETRIEVE, p))
                            commits.clear()
            finally:
                # commit_retrieve (affinity pool) touches the session: with commits, the
                # session ends once they were acknowledged (DeferredReleases)
                if not commits:
                    self._end_session(ch, rid)

    def _fetch(self, ch: Channel, toks: list[int], rid: str, salt: str, n: int,
               out: torch.Tensor | None, commits: list[list[Any]],
               same_key: tuple[str, int, int]) -> torch.Tensor | None:
        """prepare_retrieve every shard, gather; release locks on every path.

        The ``commit_retrieve`` payloads of the shards read are appended to ``commits``
        (the caller sends them, see :meth:`_release_reads`); the lookup locks of shards not
        read are freed here.
        """
        hit = n * self._chunk_size
        ws = self.world_size
        ranks = [0] if self.layout.planes == 1 else list(range(ws))
        keys = {r: self._key(toks, 0, hit, rid, salt, r) for r in range(ws)}
        calls = {r: ch.send(Op.PREPARE_RETRIEVE, [keys[r], self.instance_id]) for r in ranks}
        resps: dict[int, PrepareRetrieveResponse] = {}
        hint_key = self._hint_key(same_key)
        dst: torch.Tensor | None = None
        early: dict[int, tuple[list[Slot], int]] = {}
        try:
            if hint_key is not None:  # copy while the server answers (hint checked below)
                dst, early = self._speculative_gather(ch, calls, hint_key, ranks, n, out)
            for r in ranks:
                resps[r] = ch.wait(calls[r], PrepareRetrieveResponse)
        except BaseException:
            for r in ranks:
                ch.discard(calls[r])
            for r in range(ws):
                self._free_locks(ch, keys[r], r)
            raise
        ok = all(resps[r].success for r in ranks)
        result: torch.Tensor | None = None
        try:
            if ok:
                if out is not None:
                    dst = out
                elif dst is None:
                    ta = time.perf_counter()
                    dst = self._backend.alloc_result(self.kv_shape(hit), self._dtype)
                    self._tls.alloc_s = time.perf_counter() - ta
                kept, redone = n, 0
                for r in ranks:
                    slots = resps[r].context.slots
                    todo = range(n)
                    hint, k = early.get(r, ([], 0))
                    if hint_key is not None and slots and not resps[r].data:
                        # a chunk read early is right iff the reply names the slot it was
                        # read from: the lookup's lock kept that object there since
                        ok_early = [i for i in range(min(k, len(slots))) if slots[i] == hint[i]]
                        kept, redone = min(kept, len(ok_early)), max(redone, k - len(ok_early))
                        if len(ok_early) == n == len(slots):
                            continue  # all read while the reply was on its way
                        if slots != hint:
                            self._remember_slots((*hint_key, r), slots)
                        done = set(ok_early)
                        todo = [i for i in range(n) if i not in done]
                    else:
                        kept = 0
                    regions = self._retrieve_regions(resps[r], n, "prepare_retrieve")
                    self._copy(self._backend.gather, dst, todo, [regions[i] for i in todo],
                               self._shard_cols[r])
                self._tls.chunks = n
                self._tls.hinted, self._tls.rehinted = kept, redone
                result = dst if out is None else out.narrow(-2, 0, hit)
        finally:
            # SHM: commit releases the read lock of each object read; pickle: no-op.
            for r in range(ws):
                if r in resps and resps[r].success:
                    commits.append([keys[r], self.instance_id])
                else:
                    self._free_locks(ch, keys[r], r)
        return result

    def _hint_key(self, same_key: tuple[str, int, int]) -> tuple[str, int, int] | None:
        """Key of a prefix's read hints: its :meth:`_same_key` (None: hints not used)."""
        if self._shm is None or not self._read_hints:
            return None
        return same_key

    def _speculative_gather(self, ch: Channel, calls: dict[int, PendingCall],
                            hint_key: tuple[Any, ...], ranks: list[int], n: int,
                            out: torch.Tensor | None
                            ) -> tuple[torch.Tensor | None, dict[int, tuple[list[Slot], int]]]:
        """Gather from where the chunks lay last time until prepare_retrieve has answered.

        Runs after the lookup locked the ``n`` chunks, so none of them can move, change or
        be freed until the retrieve commits. Chunk by chunk, as long as the shard's reply
        has not arrived (so a stale hint costs at most the copies made while the server
        answered). The caller keeps chunk ``i`` only if the reply names the slot it was
        read from: then every byte read belonged to that locked object. Otherwise (the
        prefix was evicted and stored again elsewhere, or the hint key collided) it copies
        the chunk again from the reply's slot, so a stale hint never gives a wrong byte.
        The hint's slots are validated against the mapping like any reply's. Returns the
        destination (allocated when ``out`` is None) and, per shard, the hint and how many
        of its leading chunks were copied.
        """
        with self._slot_hints_mutex:
            hints = {r: self._slot_hints.get((*hint_key, r)) for r in ranks}
            for r in ranks:  # recently used: keep it longest
                if hints[r] is not None:
                    self._slot_hints.move_to_end((*hint_key, r))
        if any(h is None or len(h) != n for h in hints.values()):
            return None, {}
        hit = n * self._chunk_size
        if out is not None:
            dst = out
        else:
            ta = time.perf_counter()
            dst = self._backend.alloc_result(self.kv_shape(hit), self._dtype)
            self._tls.alloc_s = time.perf_counter() - ta
        early: dict[int, tuple[list[Slot], int]] = {}
        assert self._shm is not None
        for r in ranks:
            slots = hints[r]
            assert slots is not None
            try:
                regions = self._shm.regions(slots, self._geom, self.layout.dtype_str, "hint")
            except KVCacheSDKError:  # the pool changed: copy after the reply instead
                continue
            k = 0
            while k < n and not ch.ready(calls[r]):
                self._copy(self._backend.gather, dst, [k], [regions[k]], self._shard_cols[r])
                k += 1
            early[r] = (slots, k)
        return dst, early

    def _remember_slots(self, key: tuple[Any, ...], slots: list[Slot]) -> None:
        """Record where a prefix's chunks lie (bounded LRU)."""
        with self._slot_hints_mutex:
            self._slot_hints[key] = slots
            self._slot_hints.move_to_end(key)
            while len(self._slot_hints) > SLOT_HINTS_MAX:
                self._slot_hints.popitem(last=False)

    def _release_reads(self, commits: list[list[Any]], rid: str, same_key: Hashable) -> None:
        """Send the commits of a retrieve without waiting; its session ends after them."""
        rel = self._releases
        if rel is None:
            assert self._zmq is not None
            rel = self._releases = DeferredReleases(self._zmq, self._wake_background)
            self._ensure_background()
        rel.commit(commits, rid, same_key)

    def _retrieve_regions(self, resp: PrepareRetrieveResponse, n: int, what: str) -> list[Region]:
        if self._shm is not None and not resp.data:
            slots = resp.context.slots
            if len(slots) != n:
                raise ProtocolError(f"{what}: {len(slots)} slots for {n} chunks")
            return self._shm.regions(slots, self._geom, self.layout.dtype_str, what)
        if not resp.data:
            raise ProtocolError(f"{what}: a hit with neither slots nor data")
        numel = self._geom.chunk_nbytes // self._geom.itemsize
        spans = locate_chunks(resp.data, n, numel, self._dtype, what, self._geom.object_shape())
        if spans is not None:  # zero-copy: read the chunk bytes where they lie in the frame
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read
                flat = torch.frombuffer(resp.data, dtype=torch.uint8)
            base = flat.data_ptr()
            isz = self._geom.itemsize
            if self._backend.NAME == "torch" and any((base + off) % isz for off, _ in spans):
                # torch cannot view misaligned bytes as the dtype: one aligned copy each
                return [Region.of_tensor(flat[off:off + ln].clone()) for off, ln in spans]
            return [Region(base + off, ln, flat[off:off + ln]) for off, ln in spans]
        chunks = safe_loads_chunks(resp.data, n, numel, self._dtype, what,
                                   self._geom.object_shape())
        return [Region.of_tensor(t) for t in chunks]

    # ------------------------------------------------------------------ store
    def store(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "", *,
              request_configs: dict[str, Any] | None = None) -> bool:
        """Store ``kv`` under ``tokens``.

        ``len(tokens)`` must equal the tensor's token dimension; both are truncated to
        whole chunks.

        Args:
            kv: ``[2, L, T, D]`` (``[L, T, D]`` or ``[1, L, T, D]`` for single-plane
                models) of the model's dtype.
            tokens: The ``T`` token ids.
            cache_salt: Per-tenant isolation salt.
            request_configs: Free-form per-request metadata passed through in the keys.

        Returns:
            True exactly when every whole chunk is in the cache after the call (written now
            or already there); False when nothing whole was given or some chunk was refused.
        """
        return self.store_ex(kv, tokens, cache_salt, request_configs=request_configs).ok

    def store_ex(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "", *,
                 request_configs: dict[str, Any] | None = None) -> StoreResult:
        """Store like :meth:`store` and say what happened to every chunk.

        Returns:
            A :class:`StoreResult`.
        """
        t0 = time.perf_counter()
        src = check_kv(kv, self.layout, self._dtype)
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        t = src.shape[2]
        if len(toks) != t:
            raise InvalidArgumentError(
                f"len(tokens) is {len(toks)} but kv has {t} tokens (dimension -2); they "
                "must be equal"
            )
        n = t // self._chunk_size
        if n == 0:
            return StoreResult(0, 0, 0, 0, 0)
        toks = toks[: n * self._chunk_size]
        rc = check_request_configs(request_configs)
        with self._op(rc, name="store", t0=t0) as ch, self._same_key(salt, toks) as key:
            if self._shm is not None:
                result = self._store_shm(ch, src, toks, salt, n, key)
            else:
                result = self._store_pickle(ch, src, toks, salt, n)
        # SDK stores produce no `stored` KV events on the server (doc §11 #21): announce them
        # to local listeners. Nobody can listen unless the events module was imported.
        ev = sys.modules.get("lmcache_kv_fast.events")
        if ev is not None and result.tokens_stored and ev.has_listeners(self.model_name):
            ev.announce_store(self, toks, salt, result.tokens_stored // self._chunk_size)
        return result

    def _store_shm(self, ch: Channel, src: torch.Tensor, toks: list[int], salt: str,
                   n: int, same_key: tuple[str, int, int]) -> StoreResult:
        rid = self._rid("s")
        end = n * self._chunk_size
        ws = self.world_size
        keys = [self._key(toks, 0, end, rid, salt, r) for r in range(ws)]
        calls = [ch.send(Op.PREPARE_STORE, [keys[r], self.instance_id]) for r in range(ws)]
        written = [set() for _ in range(ws)]
        commits: list[PendingCall] = []
        try:
            resps: list[PrepareStoreResponse | None] = []
            for c in calls:
                try:
                    resps.append(ch.wait(c, PrepareStoreResponse))
                except BaseException:
                    # A reservation may exist server-side: never unregister over it.
                    self._uncommitted += 1
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
                    self._uncommitted += 1
                    raise ProtocolError(
                        f"prepare_store: chunk_indices {idx[:8]} do not match {len(ctxt.slots)} "
                        f"slots of a {n}-chunk store"
                    )
                try:
                    regions = self._shm.regions(ctxt.slots, self._geom,  # type: ignore[union-attr]
                                                self.layout.dtype_str, "prepare_store")
                except ProtocolError:
                    self._uncommitted += 1
                    raise
                plans.append((r, idx, regions, ctxt.slots))
            for r, idx, regions, _ in plans:
                if idx:
                    try:
                        self._copy(self._backend.scatter, src, idx, regions,
                                   self._shard_cols[r])
                        self._tls.chunks = max(self._tls.chunks, len(idx))
                    except OSError as err:  # pwritev into the pool file (native backend)
                        self._uncommitted += 1
                        raise KVCacheSDKError(
                            f"cannot write {len(idx)} chunks into the server's SHM pool "
                            f"/dev/shm/{self._shm.name}: {err}"  # type: ignore[union-attr]
                            + (" (the file system holding /dev/shm is full)"
                               if err.errno == errno.ENOSPC else "")
                        ) from err
            for r, idx, _, _ in plans:
                if idx:
                    commits.append(ch.send(Op.COMMIT_STORE, [keys[r], self.instance_id],
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
            self._end_session(ch, rid)
        all_written = set(range(n))
        for w in written:
            all_written &= w
        if ok_commits and len(all_written) == n:
            hint_key = self._hint_key(same_key)
            if hint_key is not None:  # a retrieve of this prefix may read these slots early
                for r, idx, _, slots in plans:
                    by_chunk = sorted(zip(idx, range(len(idx)), strict=True))
                    self._remember_slots((*hint_key, r), [slots[j] for _, j in by_chunk])
            return StoreResult(end, n, n, 0, 0)
        k = self._settled_prefix(ch, toks, salt, n)
        n_written = len([i for i in all_written if i < k]) if ok_commits else 0
        present = min(k, n)
        cached = max(0, present - n_written)
        return StoreResult(present * self._chunk_size, n, n_written, cached, n - present)

    def _store_pickle(self, ch: Channel, src: torch.Tensor, toks: list[int], salt: str,
                      n: int) -> StoreResult:
        c = self._chunk_size
        k0 = self._lookup_release(ch, toks, salt)
        if k0 >= n:
            return StoreResult(n * c, n, 0, n, 0)
        rid = self._rid("s")
        commits: list[PendingCall] = []
        builder = self._frame_builder()
        frames: list[bytearray] = []  # kept alive until the replies came (zero-copy sends)
        try:
            for r in range(self.world_size):
                key = self._key(toks, k0 * c, n * c, rid, salt, r)
                backing, frame, offsets = builder.build(n - k0)
                flat = torch.frombuffer(frame, dtype=torch.uint8)
                base = flat.data_ptr()
                regions = [Region(base + o, builder.nbytes, flat[o:o + builder.nbytes])
                           for o in offsets]
                self._copy(self._backend.scatter, src, range(k0, n), regions,
                           self._shard_cols[r])
                self._tls.chunks = n - k0
                frames.append(backing)
                commits.append(ch.send(Op.COMMIT_STORE, [key, self.instance_id], raw=[frame]))
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
            self._end_session(ch, rid)
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
        k = self._lookup_release(ch, toks, salt)
        for delay in SETTLE_DELAYS_S:
            if k >= n:
                break
            time.sleep(delay)
            k = self._lookup_release(ch, toks, salt)
        return k

    def _frame_builder(self) -> ChunkFrameBuilder:
        b = self._builder
        if b is None:
            b = self._builder = ChunkFrameBuilder(self._object_shape, self._dtype)
        return b

    # ------------------------------------------------------------------ liveness
    def _start_heartbeat(self) -> None:
        self._hb_interval = self._heartbeat_interval()
        if self._hb_interval is not None:
            self._ensure_background()

    def _ensure_background(self) -> None:
        """Start the context's background thread (pings, release acknowledgements) once."""
        with self._bg_mutex:
            if self._hb_thread is not None or self._hb_stop.is_set():
                return
            self._hb_thread = threading.Thread(
                target=self._background, name=f"lmcache-kv-fast-bg-{self.instance_id:x}",
                daemon=True,
            )
            self._hb_thread.start()

    def _wake_background(self) -> None:
        self._bg_wake.set()

    def _heartbeat_interval(self) -> float | None:
        try:
            mp = HttpInfoClient(self.http_url, CONNECT_PROBE_TIMEOUT_S).config()["mp"]
            reap = float(mp.get("worker_reap_timeout_seconds", 120.0))
        except (KVCacheSDKError, TypeError, ValueError):
            reap = 120.0
        if reap <= 0:
            return None
        return max(1.0, min(reap / 4.0, 30.0))

    def _background(self) -> None:
        """Ping for liveness every interval; collect deferred release acknowledgements.

        Acknowledgements are collected ``RELEASE_COLLECT_S`` after releases became pending
        (so a retrieve's session ends promptly even when the caller goes idle); callers
        collect them too, whenever they send new ones.
        """
        zmq_client = self._zmq
        if zmq_client is None:
            return
        interval = self._hb_interval
        next_ping = time.monotonic() + interval if interval is not None else math.inf
        try:
            ch: Channel | None = None
            while True:
                rel = self._releases
                busy = rel is not None and rel.pending()
                timeout = next_ping - time.monotonic()
                if busy:
                    timeout = min(timeout, RELEASE_COLLECT_S)
                elif rel is not None:  # a safety net: look again now and then
                    timeout = min(timeout, RELEASE_IDLE_CHECK_S)
                if timeout > 0:
                    self._bg_wake.wait(None if math.isinf(timeout) else timeout)
                    self._bg_wake.clear()
                if self._hb_stop.is_set():
                    return
                if rel is not None and rel.pending():
                    rel.collect()
                if interval is None or time.monotonic() < next_ping:
                    continue
                next_ping = time.monotonic() + interval
                try:
                    ch = ch or zmq_client.channel()
                    ch.call(Op.PING, [self.instance_id], None, min(self.timeout, interval))
                except ContextClosedError:
                    return
                except KVCacheSDKError as err:
                    logger.warning("heartbeat ping to %s failed: %s", self.url, err)
        except ContextClosedError:
            return

    def clear(self, force: bool = False) -> None:
        """Clear the server's L1 cache: every model's KV, not only this context's.

        Args:
            force: Also drop objects that are read- or write-locked by running lookups,
                retrieves or stores (of any client). Servers before 0.5.6 always do that:
                their ``clear`` has no ``force`` payload and forces.
        """
        gen = self.generation
        if not force and not gen.clear_takes_force:
            logger.debug("LMCache %s has no unforced clear; clearing locked objects too",
                         self.server_version)
        with self._op() as ch:
            if self._releases is not None:  # read locks of finished retrieves: gone first
                self._releases.settle(self.timeout)
            ch.call(Op.CLEAR, [bool(force)] if gen.clear_takes_force else [], None)

    def ping(self) -> bool:
        """Ping the server for this instance (refreshes liveness); True when it answered."""
        with self._op() as ch:
            return bool(ch.call(Op.PING, [self.instance_id], None,
                                min(self.timeout, CONNECT_PROBE_TIMEOUT_S)))

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Unregister, unmap and close the sockets. Idempotent.

        Waits (up to ``timeout``) for operations still running on other threads. The
        registration is only dropped when no prepared store is left uncommitted (the
        server would admit its slots as data, doc §3.2).
        """
        with self._ops_cv:
            if self._closing or self._closed:
                return
            self._closing = True
            drained = self._ops_cv.wait_for(lambda: self._ops == 0, timeout=self.timeout)
        if not drained:
            logger.warning("close(): operations still running after %gs; stopping them",
                           self.timeout)
        self._teardown(drained)

    def _teardown(self, drained: bool = True) -> None:
        with self._bg_mutex:
            self._hb_stop.set()
        self._bg_wake.set()
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=2.0)
        zmq_client = self._zmq
        if zmq_client is not None and drained and not zmq_client.closing and \
                self._forgotten is None and not self._peer_lost:
            # Fired releases (commits, end_session) reach the server before we unregister /
            # close. (A restarted or dead server never acknowledges them: then do not wait.)
            budget = min(self.timeout, SETTLE_ACKS_TIMEOUT_S)
            if self._releases is not None:
                self._releases.settle(budget)
            zmq_client.settle(budget)
        if zmq_client is not None and self._registered and not zmq_client.closing and \
                self._forgotten is None:
            if self._uncommitted:
                logger.warning(
                    "not unregistering instance %d: %d prepared store(s) were never committed "
                    "(unregistering would admit their slots as data)", self.instance_id,
                    self._uncommitted,
                )
            else:
                try:
                    zmq_client.call(Op.UNREGISTER_ENGINE_DRIVEN, [self.instance_id], None,
                                    min(self.timeout, CONNECT_PROBE_TIMEOUT_S))
                except KVCacheSDKError as err:
                    logger.warning("unregister on close failed: %s", err)
        if zmq_client is not None:
            zmq_client.close()
        with self._ops_cv:
            busy = self._ops
        if self._shm is not None:
            if busy and not drained:
                logger.warning("leaving the SHM mapping in place: a copy may still be running")
            else:
                self._shm.close()
        self._closing = True
        self._closed = True

    def __enter__(self) -> LMCacheKVCacheContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else getattr(self, "transport", "connecting")
        return (f"LMCacheKVCacheContext(model={self.model_name!r}, url={self.url!r}, "
                f"{state})")


def _positive_int(v: Any, what: str) -> int:
    if type(v) is not int or v <= 0:
        raise ProtocolError(f"{what}: expected a positive integer, got {v!r:.60}")
    return v


def _l1_bytes_from_config(cfg: dict[str, Any]) -> Any:
    try:
        return cfg["storage_manager"]["l1_manager_config"]["memory_config"]["size_in_bytes"]
    except (KeyError, TypeError):
        return None


def _check_chunk_fits(chunk_nbytes: int, capacity: Any, what: str) -> None:
    """Refuse a geometry whose chunk object cannot fit the server (absurd or hostile sizes)."""
    if type(capacity) is int and capacity > 0 and chunk_nbytes > capacity:
        raise KVCacheSDKError(
            f"one chunk object of this model is {chunk_nbytes} bytes but {what} holds "
            f"{capacity} bytes: nothing could ever be stored (check the model geometry, "
            "--chunk-size and --l1-size-gb)"
        )


def _align_from_config(cfg: dict[str, Any]) -> int:
    try:
        a = cfg["storage_manager"]["l1_manager_config"]["memory_config"]["align_bytes"]
    except (KeyError, TypeError):
        return DEFAULT_ALIGN_BYTES
    if type(a) is not int or a <= 0 or a & (a - 1):
        raise ProtocolError(f"/config align_bytes: expected a power of two, got {a!r:.40}")
    return a
