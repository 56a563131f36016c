"""One connected SDK context: the public face over the session and its flows.

:class:`LMCacheKVCacheContext` checks the arguments of every call
(``lmcache_kv_fast/validation.py``) and hands the call to the module of its concern:

* ``client/handshake.py`` connects (``/config``, ``/version``, ``noop``, ``/status``, the
  reader and writer registrations); ``client/session.py`` holds the shared state, guards
  every operation and tears down; ``client/liveness.py`` runs the background thread
  (pings, writer refresh, acknowledgements, late replies); ``client/late.py`` finishes
  what timed-out operations left on the server (``docs/guarantees.md``).
* ``client/lookup.py``: ``lookup`` → ``wait_prefetch_status`` (read-locks the hit prefix).
* ``client/retrieve.py``: lookup → ``prepare_retrieve`` (one per shard) → gather →
  ``commit_retrieve`` → ``end_session``, the last two sent without waiting for their
  replies (``transport/releases.py``); ``client/read_hints.py`` may gather while the
  server answers ``prepare_retrieve``.
* ``client/store.py``: ``prepare_store`` (one per shard) → scatter → ``commit_store``
  (+ ``end_session``), or without SHM a single ``commit_store`` carrying the chunks
  (pickled; a msgpack envelope on 0.5.7); lookups tell "already cached" from "L1 full"
  (docs/protocol.md §11 #10).

Results are :class:`~lmcache_kv_fast.results.StoreResult` and
:class:`~lmcache_kv_fast.results.OpTiming`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import torch

from lmcache_kv_fast.client.engine_kv import EngineOptions, per_token
from lmcache_kv_fast.client.handshake import handshake
from lmcache_kv_fast.client.lookup import cached_tokens
from lmcache_kv_fast.client.read_hints import ReadHints
from lmcache_kv_fast.client.retrieve import RetrieveFlow
from lmcache_kv_fast.client.rewrite import (
    Planner,
    RewriteFlow,
    RowsRewritten,
    TensorEdit,
    fused_kernel,
)
from lmcache_kv_fast.client.session import (
    Session,
)
from lmcache_kv_fast.client.store import StoreFlow
from lmcache_kv_fast.client.store_hooks import run_store_hooks
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from lmcache_kv_fast.layout import CpuEngineKV, KVLayout
from lmcache_kv_fast.protocol.ops import Generation
from lmcache_kv_fast.results import OpTiming, StoreResult
from lmcache_kv_fast.transport.api_key import ApiKey, resolve_api_key
from lmcache_kv_fast.validation import (
    check_connect_args,
    check_kv,
    check_out,
    check_request_configs,
    check_salt,
    normalize_tokens,
)

__all__ = ["LMCacheKVCacheContext", "OpTiming", "StoreResult"]


def _check_raw(raw: Any) -> bool:
    if not isinstance(raw, bool):
        raise InvalidTypeError(f"raw must be a bool, got {type(raw).__name__}")
    return raw


def _settable(path: str) -> property:
    """A property reading and writing ``self.<owner>.<name>`` (``path`` = "owner.name")."""
    owner, name = path.split(".")

    def fset(self: Any, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(attrgetter(path), fset)


class LMCacheKVCacheContext:
    """A connection to one LMCache MP server for one model.

    Made by :func:`lmcache_kv_fast.connect` (same arguments). Thread-safe; after ``fork()``
    its calls raise in the child (``connect()`` there).

    Args:
        url: Control URL of the server, ``tcp://host:port`` or ``grpc://host:port``.
        http_url: HTTP URL of the server, ``http://host:port``.
        model_name: Model name the KV is stored under.
        timeout: Seconds every server call may take.
        layout: Explicit geometry of the server's objects; None: the vLLM registration in
            ``/status``, or a CPU engine's registration + config (docs/engine-kv-layout.md).
        world_size: Tensor-parallel KV shards (with ``layout``; else from ``/status``).
        model_config: A CPU engine's configuration (dir, ``config.json``, dict).
        block_size: A CPU engine's vLLM block size when it cannot be read.
        dtype: A CPU engine's KV dtype when it differs from the configuration's.
        kernel: A CPU engine's attention kernel when it runs on another machine.
        copy_threads: Threads of the native copy pool (None: env or usable cores).
        heartbeat: Ping the server so it never reaps this live client (docs/protocol.md §3.11).
        read_hints: Copy a retrieved prefix from where it lay last time until the server's
            ``prepare_retrieve`` reply is in (SHM only; each chunk kept only when the reply
            names the slot it was read from).
        api_key: A key-protected server's API key (None: ``LMCACHE_API_KEY[_FILE]``).

    Raises:
        KVCacheSDKError: The server cannot be used (see the message for why).
    """

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
        model_config: Any = None,
        block_size: int | None = None,
        dtype: torch.dtype | str | None = None,
        kernel: str | None = None,
        api_key: str | None = None,
    ) -> None:
        check_connect_args(url, http_url, model_name, timeout, world_size, copy_threads)
        engine = EngineOptions(model_config, block_size, dtype, kernel)
        key = resolve_api_key(api_key)  # before anything is created
        s = self._session = Session(url, http_url.rstrip("/"), model_name, float(timeout))
        s.api_key = key
        self._hints = ReadHints(s, bool(read_hints))
        self._retrieval = RetrieveFlow(s, self._hints)
        self._storing = StoreFlow(s, self._hints)
        self._rewriting = RewriteFlow(s, self._retrieval, self._storing)
        try:
            if copy_threads is not None:
                s.backend.set_threads(copy_threads)
            handshake(s, layout, world_size, engine)
            if heartbeat:
                s.background.start_heartbeat()
        except BaseException:
            s.teardown()
            raise
        # Nothing of the session refers back to the context (the background thread holds
        # the session): a context dropped without close() is collected, then closed.
        self._finalizer = weakref.finalize(self, s.collected)

    # ------------------------------------------------------------------ properties
    @property
    def url(self) -> str:
        """ZMQ URL of the server."""
        return self._session.url

    @property
    def http_url(self) -> str:
        """HTTP URL of the server (no trailing slash)."""
        return self._session.http_url

    @property
    def api_key(self) -> ApiKey | None:
        """The server's API key in use (its repr hides the secret), or None."""
        return self._session.api_key

    @property
    def model_name(self) -> str:
        """Model name the KV is stored under."""
        return self._session.model_name

    @property
    def timeout(self) -> float:
        """Seconds every server call may take."""
        return self._session.timeout

    @property
    def mq_timeout(self) -> float:
        """Seconds every server call may take (upstream name)."""
        return self._session.timeout

    @property
    def instance_id(self) -> int:
        """This client's engine-driven instance id on the server (random, 63 bits).

        The *reader* registration: lookups and retrieves use it; the heartbeat pings it.
        """
        return self._session.instance_id

    @property
    def writer_instance_id(self) -> int:
        """The engine-driven instance id this client's stores use (random, 63 bits).

        A second registration on the SHM plane, never pinged, so that a client that dies
        in the middle of a store is reaped only after the server's registration grace,
        when its unfilled reservation can no longer be admitted (``docs/guarantees.md``).
        Equal to :attr:`instance_id` on the pickle plane. ``/status`` lists both.
        """
        return self._session.writer_id

    @property
    def generation(self) -> Generation:
        """Wire dialect of the server."""
        return self._session.generation

    @property
    def server_version(self) -> str:
        """``/version`` of the server, or the detected generation."""
        return self._session.server_version

    @property
    def transport(self) -> str:
        """Data plane: ``"shm"``, or ``"pickle"`` for the inline one (a msgpack envelope on 0.5.7)."""
        return self._session.transport

    @property
    def layout(self) -> KVLayout:
        """Geometry of the model's KV as ``retrieve`` / ``store`` take it by default.

        For a CPU engine (:attr:`engine_kv`) the per-token two-plane layout; the server's
        objects are :attr:`raw_layout`.
        """
        s = self._session
        return s.token_layout if s.engine_kv is not None and s.token_layout else s.layout

    @property
    def raw_layout(self) -> KVLayout:
        """Geometry of the server's objects (what ``raw=True`` moves; registered)."""
        return self._session.layout

    @property
    def engine_kv(self) -> CpuEngineKV | None:
        """The CPU engine's KV converter (raw rows <-> per-token K/V), or None.

        Set when ``connect()`` resolved an engine-driven CPU engine's geometry; then
        ``retrieve`` / ``store`` convert unless called with ``raw=True``.
        """
        return self._session.engine_kv

    @property
    def world_size(self) -> int:
        """Tensor-parallel KV shards."""
        return self._session.world_size

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk of the server."""
        return self._session.chunk_size

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        s = self._session
        return s.closed or s.closing

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the KV tensors."""
        return self._session.dtype

    def kv_shape(self, tokens: int, *, raw: bool = False) -> tuple[int, ...]:
        """Shape of the KV tensor of ``tokens`` tokens: ``[2, L, T, D]`` or ``[L, T, D]``.

        With ``raw`` (CPU engine) the shape of the engine's rows ``[L, T, NH*2*HS]``.
        """
        s = self._session
        if not _check_raw(raw) and s.engine_kv is not None:
            return s.engine_kv.token_layout.tensor_shape(tokens)
        return s.kv_shape(tokens)

    @property
    def last_timing(self) -> OpTiming | None:
        """Phase breakdown of this thread's last ``store`` / ``retrieve`` / ``lookup``.

        None before the first call on this thread. See :class:`OpTiming`.
        """
        return getattr(self._session.tls, "timing", None)

    # ------------------------------------------------------------------ operations
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
        s = self._session
        s.check_process()
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        n_tok = len(toks) // s.chunk_size * s.chunk_size
        if n_tok == 0:
            return 0
        rc = check_request_configs(request_configs)
        return cached_tokens(s, toks[:n_tok], salt, rc, t0)

    def retrieve(self, tokens: Sequence[int], cache_salt: str = "", *,
                 out: torch.Tensor | None = None,
                 request_configs: dict[str, Any] | None = None,
                 raw: bool = False) -> torch.Tensor | None:
        """Retrieve the KV of the cached prefix of ``tokens``.

        For a CPU engine (:attr:`engine_kv`) the result is the per-token K/V
        ``[2, L, hit, NH*HS]``, converted from the engine's rows on the way out of the
        server's memory; ``raw=True`` gives the engine's rows ``[L, hit, NH*2*HS]`` as the
        server holds them (bit-exact copies).

        Args:
            tokens: Token ids from position 0 (a trailing partial chunk is ignored).
            cache_salt: Per-tenant isolation salt.
            request_configs: Free-form per-request metadata passed through in the keys.
            out: Optional contiguous CPU tensor of the model's dtype, shaped
                ``[2, L, >=T, D]`` (``[L, >=T, D]`` for single-plane models and raw CPU
                engine rows; ``ctx.kv_shape(T, raw=raw)``), to write into;
                the result is then ``out[..., :hit, :]``. Its content beyond the hit, on a
                miss or when the call raises is unspecified (read hints may have filled it
                from the prefix's last known chunks; never from unvalidated slots).
            raw: A CPU engine's rows as they are (no conversion).

        Returns:
            A contiguous ``[2, L, hit, D]`` tensor (``[L, hit, D]`` for single-plane
            models), or None when fewer than one chunk is given or nothing is cached.
        """
        t0 = time.perf_counter()
        s = self._session
        s.check_process()
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        n_tok = len(toks) // s.chunk_size * s.chunk_size
        tok = not _check_raw(raw) and s.engine_kv is not None
        if out is not None:
            out = check_out(out, n_tok, self.layout if tok else s.layout, s.dtype)
        if n_tok == 0:
            return None
        rc = check_request_configs(request_configs)
        with per_token(s, tok):
            return self._retrieval.retrieve(toks[:n_tok], salt, out, rc, t0)

    def store(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "", *,
              request_configs: dict[str, Any] | None = None, raw: bool = False) -> bool:
        """Store ``kv`` under ``tokens``.

        ``len(tokens)`` must equal the tensor's token dimension; both are truncated to
        whole chunks.

        Args:
            kv: ``[2, L, T, D]`` (``[L, T, D]`` or ``[1, L, T, D]`` for single-plane
                models) of the model's dtype. For a CPU engine the per-token K/V, written
                back in the engine's order (whole chunks); with ``raw`` the engine's rows.
            tokens: The ``T`` token ids.
            cache_salt: Per-tenant isolation salt.
            request_configs: Free-form per-request metadata passed through in the keys.
            raw: ``kv`` is a CPU engine's rows ``[L, T, NH*2*HS]`` (stored as they are).

        Returns:
            True exactly when every whole chunk is in the cache after the call (written now
            or already there); False when nothing whole was given or some chunk was refused.
        """
        return self.store_ex(kv, tokens, cache_salt, request_configs=request_configs,
                             raw=raw).ok

    def store_ex(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "", *,
                 request_configs: dict[str, Any] | None = None,
                 raw: bool = False) -> StoreResult:
        """Store like :meth:`store` and say what happened to every chunk.

        Returns:
            A :class:`StoreResult`.
        """
        t0 = time.perf_counter()
        s = self._session
        s.check_process()
        tok = not _check_raw(raw) and s.engine_kv is not None
        src = check_kv(kv, self.layout if tok else s.layout, s.dtype)
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        t = src.shape[2]
        if len(toks) != t:
            raise InvalidArgumentError(
                f"len(tokens) is {len(toks)} but kv has {t} tokens (dimension -2); they "
                "must be equal"
            )
        n = t // s.chunk_size
        if n == 0:
            return StoreResult(0, 0, 0, 0, 0)
        toks = toks[: n * s.chunk_size]
        rc = check_request_configs(request_configs)
        with per_token(s, tok):
            result = self._storing.store(src, toks, salt, n, rc, t0)
        if result.tokens_stored:  # announced by events/ (the server records no event for it)
            run_store_hooks(self, toks, salt, result.tokens_stored // s.chunk_size)
        return result

    @property
    def rewrites_rows(self) -> bool:
        """Whether :meth:`rewrite_rows` runs here.

        On the SHM plane, for per-token chunks (the backend's ``fused_rows``) and for a CPU
        engine's rows whose in-block order is one element map per block
        (``fused_blocks``, :meth:`CpuEngineKV.block_offsets`); not on the inline plane.
        """
        return fused_kernel(self._session) is not None

    def rewrite_rows(self, tokens: Sequence[int], planner: Planner, apply: TensorEdit,
                     cache_salt: str = "", *, request_configs: dict[str, Any] | None = None,
                     stages: dict[str, float] | None = None) -> RowsRewritten | None:
        """Rewrite the cached prefix of ``tokens`` slot to slot (``batch.rewrite``'s fused path).

        The prefix is read-locked; ``planner(hit_tokens)`` (``edits.row_plan``) says which
        row goes where and how K turns; the rows move once from the read slots into the
        new sequence's reserved ones; the store is committed, then the reads released.
        ``apply(kv, hit_tokens)`` is the same edit on a tensor, used only when the plan
        does not fit the core or a late reservation needs a snapshot. ``stages`` gets the
        seconds of each stage as it ends (``retrieve``, ``fn``, ``store``, ``copy``).

        Returns:
            What was done (:class:`~lmcache_kv_fast.client.rewrite.RowsRewritten`), or None
            when nothing of ``tokens`` is cached.

        Raises:
            KVCacheSDKError: Not available on this context (:attr:`rewrites_rows`); an
                ``EditError`` when the planner or the edit raised; server errors as a
                retrieve / store.
        """
        t0 = time.perf_counter()
        s = self._session
        s.check_process()
        if not self.rewrites_rows:
            raise KVCacheSDKError("rewrite_rows needs the SHM plane and per-token chunks or a "
                                  "CPU engine's rows of one element map per block (see "
                                  "rewrites_rows)")
        toks = normalize_tokens(tokens)
        salt = check_salt(cache_salt)
        n_tok = len(toks) // s.chunk_size * s.chunk_size
        if n_tok == 0:
            return None
        rc = check_request_configs(request_configs)
        with per_token(s, s.engine_kv is not None):  # a fallback's tensors are per token
            done = self._rewriting.rewrite(toks[:n_tok], salt, planner, apply, rc, t0,
                                           {} if stages is None else stages)
        if done is not None and done.stored.chunks_written:
            new = done.tokens[: done.stored.chunks_total * s.chunk_size]
            run_store_hooks(self, new, salt, done.stored.tokens_stored // s.chunk_size)
        return done

    def clear(self, force: bool = False) -> None:
        """Clear the server's L1 cache: every model's KV, not only this context's.

        Args:
            force: Also drop objects that are read- or write-locked by running lookups,
                retrieves or stores (of any client). Servers before 0.5.6 always do that:
                their ``clear`` has no ``force`` payload and forces.
        """
        self._session.clear(force)

    def ping(self) -> bool:
        """Ping the server for this instance (refreshes liveness); True when it answered."""
        return self._session.ping()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Settle, unregister, unmap and close the sockets. Idempotent.

        Waits (up to ``timeout``) for operations still running on other threads, then
        (for at most ``min(timeout, 5 s)``) for the late replies of operations that timed
        out, finishing what they left on the server (``client/late.py``). The writer
        registration is only dropped when no reservation of a failed store can be pending
        (the server would admit its slots as data, docs/protocol.md §3.2). In a
        child process after ``fork()`` it does nothing (everything it would release is
        the parent's).
        """
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin.detach()
        self._session.close()

    def __enter__(self) -> LMCacheKVCacheContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_process(self) -> None:
        """Raise KVCacheSDKError when used in a process other than the creating one.

        (A child after fork(): see ``Session.check_process``; batch and event entry points
        call it.)
        """
        self._session.check_process()

    def __repr__(self) -> str:
        state = "closed" if self.closed else getattr(self._session, "transport", "connecting")
        return (f"LMCacheKVCacheContext(model={self.model_name!r}, url={self.url!r}, "
                f"{state})")

    # ------------------------------------------------------------------ internals
    # The private names tests and benches reach, as they were before the split.
    _shm = property(attrgetter("_session.shm"))
    _geom = property(attrgetter("_session.geom"))
    _backend = property(attrgetter("_session.backend"))
    _releases = property(attrgetter("_session.releases"))
    _hb_thread = property(attrgetter("_session.background.thread"))
    _hb_stop = property(attrgetter("_session.background.stop_event"))
    _op = property(attrgetter("_session.op"))
    _rid = property(attrgetter("_session.rid"))
    _key = property(attrgetter("_session.key"))
    _copy = property(attrgetter("_session.copy"))
    _end_session = property(attrgetter("_session.end_session"))
    _slot_hints = property(attrgetter("_hints.lru"))
    _remember_slots = property(attrgetter("_hints.remember"))
    #: Use read hints (``connect(read_hints=...)``); benches/bench_read_hints.py flips it.
    _read_hints = _settable("_hints.enabled")
    #: Send a retrieve's commit without waiting for its reply (transport/releases.py).
    #: False restores the awaited flow; only benches/bench_release.py turns it off.
    _defer_releases = _settable("_retrieval.defer_releases")
