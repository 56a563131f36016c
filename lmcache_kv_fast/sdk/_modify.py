"""The modify phase of a batched stream: wait → retrieve → ``fn`` → store, pipelined.

Upstream 0.5.6 runs one thread per stream, each polling with full retrieves until the
engine's store is visible, each holding its stream's KV (and its edit) until the end, so
every stream's KV is in memory at once and the first failure hides the others. Here the
streams are grouped by KV context and salt and each group goes through this project's
pipelined rewrite engine (``engine_adapter.py``: the engine of ``batch.rewrite``): at
most ``max_in_flight`` streams are between their read and their store, each waited for,
read and stored on its own I/O thread, and one edit thread runs ``fn``, so one stream's
server round trips overlap the others' work; a stream's rows are read and stored
through reused row buffers (``kvio.py``). With a library edit planned without reading
the KV, a stream's rows go slot to slot instead (``_fused.py``; the report's path).
The wait for the engine's store is lookups with back-off
(:mod:`lmcache_kv_fast.sdk._wait`), and every stream's outcome is recorded.

A server that died stops the phase after one failed stream and one unanswered liveness
ping (``ServerUnavailableError``, not the timeout per stream): the streams in flight are
recorded as failed, the others as not attempted (stage ``not_attempted``; streams of
another group on the same server too), and :attr:`ModifyOutcome.server_error` is set.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_kv_fast.errors import ServerUnavailableError
from lmcache_kv_fast.sdk._engine_adapter import run_rewrite_items
from lmcache_kv_fast.sdk._fused import fused_hooks
from lmcache_kv_fast.sdk._kvio import StreamKV
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.context import ModifyFnType
from lmcache_kv_fast.sdk.request import (
    LMCacheRequestStream,
    LMCacheRequestStreamError,
    call_modify_fn,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "ModifyOutcome", "StreamModify", "default_max_in_flight",
           "modify_streams"]

#: Most streams between their read and their store at once, by default (the cap of
#: :func:`default_max_in_flight`).
DEFAULT_MAX_IN_FLIGHT = 4
#: Fewest, by default: one stream's server round trips overlap another's work.
MIN_DEFAULT_IN_FLIGHT = 2


def default_max_in_flight() -> int:
    """The default bound: the cores this process may run on, from 2 up to 4.

    A modify is CPU-bound once two streams overlap (their round trips hide behind each
    other's conversions, edit and copies), so more streams in flight than cores cost
    memory and buy no speed.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or MIN_DEFAULT_IN_FLIGHT
    return max(MIN_DEFAULT_IN_FLIGHT, min(DEFAULT_MAX_IN_FLIGHT, cores))
KV = LMCacheSDKCacheKind.KV


@dataclass
class StreamModify:
    """One stream's modify: what was read, waited for, edited and stored.

    Attributes:
        stream: The stream.
        cached_len: Tokens of the stream's cached KV prefix that were edited.
        new_tokens: The tokens the stored edit stands for.
        wait_s: Seconds waiting for the engine's store (all kinds).
        lookups: Lookups sent while waiting.
        nbytes: Bytes read (all kinds).
        kv_nbytes: Bytes of KV read.
        error: Why it failed (None when it was stored).
        stage: Where it failed (``retrieve`` (includes the wait), ``fn``, ``store``, or
            ``not_attempted``: the server was found gone before this stream started).
        path: How a modified stream's rows moved: ``"fused"`` (slot to slot, a library
            edit; ``_fused.py``) or ``"tensor"`` (read into a tensor, ``fn``, stored).
    """

    stream: LMCacheRequestStream
    cached_len: int = 0
    new_tokens: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    lookups: int = 0
    nbytes: int = 0
    kv_nbytes: int = 0
    error: str | None = None
    stage: str = ""
    path: str = ""
    extra: dict[LMCacheSDKCacheKind, torch.Tensor] = field(default_factory=dict)


@dataclass
class ModifyOutcome:
    """All streams' results of one modify.

    Attributes:
        items: One :class:`StreamModify` per stream, in the order given.
        seconds: Wall time.
        stage_seconds: Summed per-stage time (``retrieve`` includes the wait).
        peak_in_flight: Most streams between read and store at once.
        max_in_flight: The bound.
        bytes_stored: Bytes of edited KV stored.
        server_error: Why the phase stopped early: the server was found gone (None: every
            stream ran).
    """

    items: list[StreamModify]
    seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    peak_in_flight: int = 0
    max_in_flight: int = 0
    bytes_stored: int = 0
    server_error: ServerUnavailableError | None = None

    @property
    def failed(self) -> list[StreamModify]:
        """The streams that were not modified."""
        return [m for m in self.items if m.error is not None]


def modify_streams(streams: Sequence[LMCacheRequestStream], fn: ModifyFnType, *,
                   timeout: float = 30.0, poll_interval: float = 0.2,
                   max_in_flight: int | None = None, progress: bool = False,
                   on_done: Callable[[StreamModify], None] | None = None) -> ModifyOutcome:
    """Modify every stream (see the module docstring); a failure does not stop the others.

    Successful streams are updated (tokens, suffix); failed ones are left unchanged and
    reported in the outcome. ``max_in_flight`` None: :func:`default_max_in_flight`.
    """
    t0 = time.perf_counter()
    if max_in_flight is None:
        max_in_flight = default_max_in_flight()
    items = [StreamModify(s) for s in streams]
    out = ModifyOutcome(items, max_in_flight=max_in_flight)
    groups: dict[tuple[int, str], list[StreamModify]] = {}
    gone: dict[str, ServerUnavailableError] = {}  # server url -> why it was found gone
    for m in items:
        try:
            ctx = m.stream.context(KV)
        except LMCacheRequestStreamError as err:
            m.error, m.stage = str(err), "fn"
            continue
        groups.setdefault((id(ctx), m.stream.cache_salt), []).append(m)
    for group in groups.values():
        url = group[0].stream.context(KV).kv_context.url
        if url in gone:  # the same server, found gone by an earlier group: not sent
            _not_attempted(group, on_done)
            continue
        try:
            _run_group(group, fn, timeout, poll_interval, max_in_flight, progress, out,
                       on_done)
        except ServerUnavailableError as err:
            gone[url] = out.server_error = err
    out.seconds = time.perf_counter() - t0
    return out


def _read(m: StreamModify, kind: LMCacheSDKCacheKind, timeout: float,
          poll_interval: float, read: Any = None) -> torch.Tensor:
    """Read one kind of the stream's cache; the wait is counted even when it fails."""
    try:
        t, res = m.stream.read_cached(kind, timeout, poll_interval, read=read)
    except LMCacheRequestStreamError as err:
        if err.wait is not None:
            m.wait_s += err.wait.seconds
            m.lookups += err.wait.lookups
        raise
    if res.lookups:
        m.wait_s += res.seconds
    m.lookups += res.lookups
    m.nbytes += _nbytes(t)
    return t


def _not_attempted(group: Sequence[StreamModify],
                   on_done: Callable[[StreamModify], None] | None) -> None:
    for m in group:
        m.error = "not attempted: the server is unavailable (ModifyOutcome.server_error)"
        m.stage = "not_attempted"
        m.extra = {}
        if on_done is not None:
            on_done(m)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run_group(group: list[StreamModify], fn: ModifyFnType, timeout: float,
               poll_interval: float, max_in_flight: int, progress: bool, out: ModifyOutcome,
               on_done: Callable[[StreamModify], None] | None) -> None:
    first = group[0].stream
    sdk_ctx = first.context(KV)
    salt = first.cache_salt
    by_kv: dict[int, StreamModify] = {}
    reported: set[int] = set()
    io = StreamKV(sdk_ctx)

    def fetch(_ctx: Any, m: StreamModify) -> tuple[torch.Tensor | None, Sequence[int]]:
        s = m.stream
        kv = _read(m, KV, timeout, poll_interval, io.read)
        m.kv_nbytes = _nbytes(kv)
        for kind in s.contexts:
            if kind is not KV:
                m.extra[kind] = _read(m, kind, timeout, poll_interval)
        m.cached_len = kv.shape[-2]
        by_kv[id(kv)] = m
        return kv, s.tokens[: m.cached_len]

    def edit(kv: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        m = by_kv.pop(id(kv))
        tensors = {KV: kv, **m.extra}
        m.extra = {}
        new_kv, new_tokens = call_modify_fn(fn, tensors, tokens, m.stream.request_stream_id)
        m.new_tokens = new_tokens
        return new_kv, new_tokens

    def on_result(index: int, status: str, stage: str, reason: str,
                  stages: dict[str, float]) -> None:
        m = group[index]
        reported.add(index)
        for k, v in stages.items():
            out.stage_seconds[k] = out.stage_seconds.get(k, 0.0) + v
        if status == "ok":
            m.path = m.path or "tensor"
            m.stream.apply_edit(m.cached_len, m.new_tokens)
            chunk = sdk_ctx.chunk_size
            per_token = m.kv_nbytes // max(1, m.cached_len)
            out.bytes_stored += per_token * (len(m.new_tokens) // chunk * chunk)
        else:
            m.error, m.stage = reason or status, stage or "retrieve"
            m.extra = {}
            logger.warning("modify of stream %s failed at %s: %s", m.stream.request_stream_id,
                           m.stage, m.error)
        if on_done is not None:
            on_done(m)

    core = sdk_ctx.kv_context
    token_bytes = math.prod(core.kv_shape(1)) * core.dtype.itemsize
    try:
        peak = run_rewrite_items(core, group, edit, salt, fetch=fetch,
                                 store=io.store, on_result=on_result,
                                 max_in_flight=max_in_flight, progress=progress,
                                 fused=fused_hooks(fn, timeout, poll_interval, token_bytes))
    except ServerUnavailableError as err:
        # the engine stopped: the streams it never reported were not attempted
        rep = getattr(err, "report", None)
        out.peak_in_flight = max(out.peak_in_flight, int(getattr(rep, "peak_in_flight", 0)))
        _not_attempted([m for i, m in enumerate(group) if i not in reported], on_done)
        raise
    out.peak_in_flight = max(out.peak_in_flight, peak)
