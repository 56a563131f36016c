"""The batched modify of one KV context and salt: streams read, edited and stored in groups.

Per stream, a modify is ~8 requests to the server (lookup, prefetch status, prepare and
commit of the read, end of its session; prepare and commit of the store, end of its
session) around ~1 ms of edit: one stream after the other, the client mostly waits for
replies. Here the streams go in groups of at most ``max_in_flight`` (and at most
:data:`GROUP_BYTES` of KV): the group's reads are one pipelined multi-sequence retrieve
(``client/multi.py``: every lookup sent, then every prepare, then the copies), each
stream is converted, edited and converted back into its row buffer, then the group's
edits are one pipelined multi-sequence store. While a group is edited the next group's
lookups are already on the server.

What a stream gets and what is kept per stream is the same as the one-stream path
(``LMCacheRequestStream.read_cached`` / ``modify_kv``): a stream whose engine store is
not complete yet at the group's read waits for it with lookups and back-off
(:mod:`lmcache_kv_fast.sdk.wait`) on its own; a failure (wait, read, ``fn``, store) is
that stream's result only. Memory: the group's row buffers (the server's objects of at
most ``max_in_flight`` streams, reused from group to group) plus one stream's per-token
K/V and its edit at a time.

For a CPU engine the server's objects are the engine's rows and ``fn`` edits per-token
K/V (converted with one call each way); otherwise the objects are what ``fn`` edits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache_kv_fast.client.multi import MultiIO
from lmcache_kv_fast.copy import backend
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError, KVCacheSDKError
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache_kv_fast.sdk.kvio import StreamKV
from lmcache_kv_fast.sdk.progress import Progress
from lmcache_kv_fast.sdk.request import LMCacheRequestStreamError, call_modify_fn

if TYPE_CHECKING:
    from lmcache_kv_fast.sdk.context import LMCacheSDKContext, ModifyFnType
    from lmcache_kv_fast.sdk.modify import ModifyOutcome, StreamModify

logger = logging.getLogger(__name__)

__all__ = ["GROUP_BYTES", "modify_in_groups"]

#: Most bytes of the server's objects (row buffers) a group reads at once.
GROUP_BYTES = 16 << 20
KV = LMCacheSDKCacheKind.KV
ReadFn = Callable[["StreamModify", LMCacheSDKCacheKind, Any], torch.Tensor]


class _Slot:
    """One stream of the group being processed."""

    def __init__(self, m: StreamModify) -> None:
        self.m = m
        self.target = 0
        self.rows: torch.Tensor | None = None  # the server's objects read (row buffer)
        self.kv: torch.Tensor | None = None  # per-token K/V read another way (waited)
        self.store: tuple[torch.Tensor, list[int]] | None = None


class _Groups:
    """The state of one context's batched modify (see the module docstring)."""

    def __init__(self, sdk_ctx: LMCacheSDKContext, fn: ModifyFnType, out: ModifyOutcome,
                 read: ReadFn, io: MultiIO) -> None:
        self.ctx = sdk_ctx
        self.core = sdk_ctx.kv_context
        self.cpu = self.core.engine_kv
        self.fn = fn
        self.out = out
        self.read = read
        self.io = io
        self.kvio = StreamKV(sdk_ctx)
        self.buffers: list[torch.Tensor] = []

    def stage(self, name: str, t0: float) -> None:
        st = self.out.stage_seconds
        st[name] = st.get(name, 0.0) + time.perf_counter() - t0

    def buffer(self, i: int, tokens: int) -> torch.Tensor:
        """Row buffer ``i`` viewed as the objects of ``tokens`` tokens (grown when needed)."""
        shape = self.core.kv_shape(tokens, raw=True)
        numel = 1
        for d in shape:
            numel *= d
        while len(self.buffers) <= i:
            self.buffers.append(torch.empty(0, dtype=self.core.dtype))
        if self.buffers[i].numel() < numel:
            self.buffers[i] = torch.empty(numel, dtype=self.core.dtype)
        return self.buffers[i].narrow(0, 0, numel).view(shape)

    # ------------------------------------------------------------------ phases
    def send_reads(self, slots: list[_Slot]) -> Any:
        """Start the group's reads (their lookups go out now); returns the pending read."""
        salt = slots[0].m.stream.cache_salt if slots else ""
        toks, outs, ready = [], [], []
        for i, sl in enumerate(slots):
            s = sl.m.stream
            try:
                sl.target = s.expected_target(KV)
            except LMCacheRequestStreamError as err:
                self.fail(sl, "retrieve", str(err))
                continue
            toks.append(s.tokens[: sl.target])
            outs.append(self.buffer(i, sl.target) if self.cpu is not None else
                        backend().alloc_result(self.core.kv_shape(sl.target), self.core.dtype))
            ready.append(sl)
        return self.io.start_retrieve(toks, [salt] * len(toks), outs), ready

    def finish_reads(self, pending: Any) -> None:
        """Finish the group's reads; a stream found incomplete waits for its store alone."""
        started, ready = pending
        try:
            got = self.io.finish_retrieve(started)
        except KVCacheSDKError as err:
            got = [err] * len(ready)
        for sl, g in zip(ready, got, strict=True):
            m = sl.m
            try:
                if isinstance(g, BaseException):
                    raise LMCacheRequestStreamError(
                        f"stream {m.stream.request_stream_id}: reading its KV failed: {g}")
                if g is not None and g.shape[-2] >= sl.target:
                    sl.rows = g
                    m.nbytes += _nbytes(g)
                else:  # the engine's store is not (all) visible yet: wait, then read
                    sl.kv = self.read(m, KV, self.kvio.read)
                    sl.rows = None
                for kind in m.stream.contexts:
                    if kind is not KV:
                        m.extra[kind] = self.read(m, kind, None)
            except LMCacheRequestStreamError as err:
                self.fail(sl, "retrieve", str(err))

    def edit(self, i: int, sl: _Slot) -> None:
        """Convert, call ``fn``, convert back into the slot's row buffer."""
        m = sl.m
        if m.error is not None:
            return
        kv = sl.kv
        if kv is None:
            assert sl.rows is not None
            kv = sl.rows if self.cpu is None else self.cpu.to_tokens(
                sl.rows, out=backend().alloc_result(
                    (2, self.cpu.num_layers, sl.rows.shape[1],
                     self.cpu.num_kv_heads * self.cpu.head_dim), self.cpu.dtype))
        sl.kv = sl.rows = None
        m.kv_nbytes = _nbytes(kv)
        m.cached_len = kv.shape[-2]
        tensors = {KV: kv, **m.extra}
        m.extra = {}
        try:
            new_kv, new_tokens = call_modify_fn(self.fn, tensors, m.stream.tokens[: m.cached_len],
                                                m.stream.request_stream_id)
            del kv, tensors
            m.new_tokens = new_tokens
            sl.store = self.to_server(i, new_kv, new_tokens)
        except (LMCacheRequestStreamError, InvalidArgumentError, InvalidTypeError) as err:
            self.fail(sl, "fn", str(err))

    def to_server(self, i: int, kv: torch.Tensor, toks: list[int]
                  ) -> tuple[torch.Tensor, list[int]]:
        """The edit as the server's objects (whole chunks), in row buffer ``i`` for a CPU engine.

        Raises:
            InvalidArgumentError / InvalidTypeError: ``kv`` is not of the model's
                per-token shape and dtype.
        """
        if kv.dtype != self.core.dtype:
            raise InvalidTypeError(f"the edited KV has dtype {kv.dtype}, expected "
                                   f"{self.core.dtype} (the model's KV dtype)")
        if self.cpu is None:
            return kv, toks
        if kv.dim() != 4 or kv.shape[2] != len(toks):
            raise InvalidArgumentError(
                f"the edited KV must be per-token K/V [2, L, T, D] with T = len(tokens) = "
                f"{len(toks)}, got {list(kv.shape)}")
        n = len(toks) // self.core.chunk_size * self.core.chunk_size
        if n == 0:
            return kv.narrow(2, 0, 0), []
        return self.cpu.to_raw(kv.narrow(2, 0, n), out=self.buffer(i, n)), toks[:n]

    def store(self, slots: list[_Slot]) -> None:
        """Store the group's edits with one pipelined multi-sequence store."""
        todo = [sl for sl in slots if sl.store is not None and sl.m.error is None]
        items = [sl.store for sl in todo if sl.store is not None]
        try:
            res = self.io.store_many([kv for kv, _ in items], [t for _, t in items],
                                     [sl.m.stream.cache_salt for sl in todo]) if items else []
        except KVCacheSDKError as err:
            res = [err] * len(todo)
        for sl, r in zip(todo, res, strict=True):
            sl.store = None
            m = sl.m
            if isinstance(r, BaseException):
                self.fail(sl, "store", f"{type(r).__name__}: {r}")
            elif not r.ok:
                self.fail(sl, "store", _incomplete(r))
            else:
                m.stream.apply_edit(m.cached_len, m.new_tokens)
                per_token = m.kv_nbytes // max(1, m.cached_len)
                self.out.bytes_stored += per_token * r.tokens_stored

    def fail(self, sl: _Slot, stage: str, reason: str) -> None:
        m = sl.m
        if m.error is None:
            m.error, m.stage = reason, stage
            logger.warning("modify of stream %s failed at %s: %s",
                           m.stream.request_stream_id, stage, reason)
        m.extra = {}
        sl.kv = sl.rows = None
        sl.store = None


def modify_in_groups(group: Sequence[StreamModify], fn: ModifyFnType, read: ReadFn, *,
                     max_in_flight: int, progress: bool, out: ModifyOutcome,
                     on_done: Callable[[StreamModify], None] | None) -> bool:
    """Modify ``group`` (one KV context and salt) in groups; False when this does not apply.

    Args:
        group: The streams (one context, one salt).
        fn: The user's edit.
        read: ``read(m, kind, reader)``: one stream's cache of ``kind`` once visible
            (waits with lookups; ``reader`` reads it, None: the context's retrieve).
        max_in_flight: Most streams per group.
        progress: Show a progress bar.
        out: The outcome to record stage times, bytes and the peak into.
        on_done: Called per stream, in the given order, once it is settled.

    Returns:
        False (nothing done) when the context has no SHM plane: the caller runs the
        one-stream pipeline.
    """
    sdk_ctx = group[0].stream.context(KV)
    io = MultiIO(sdk_ctx.kv_context)
    if not io.supported:
        return False
    g = _Groups(sdk_ctx, fn, out, read, io)
    size = _group_size(g, group, max_in_flight)
    batches = [[_Slot(m) for m in group[i:i + size]] for i in range(0, len(group), size)]
    bar = Progress(len(group), "modify", progress)
    try:
        t0 = time.perf_counter()
        pending = g.send_reads(batches[0])
        g.stage("retrieve", t0)
        for k, slots in enumerate(batches):
            out.peak_in_flight = max(out.peak_in_flight, len(slots))
            t0 = time.perf_counter()
            g.finish_reads(pending)
            # the next group's lookups run on the server while this group is edited
            pending = g.send_reads(batches[k + 1]) if k + 1 < len(batches) else None
            g.stage("retrieve", t0)
            t0 = time.perf_counter()
            for i, sl in enumerate(slots):
                g.edit(i, sl)
            g.stage("fn", t0)
            t0 = time.perf_counter()
            g.store(slots)
            g.stage("store", t0)
            for sl in slots:
                if on_done is not None:
                    on_done(sl.m)
                bar.update()
    finally:
        bar.close()
        io.close()
    return True


def _group_size(g: _Groups, group: Sequence[StreamModify], max_in_flight: int) -> int:
    longest = max(m.stream.expected_cached_tokens() for m in group)
    per_stream = 1
    for d in g.core.kv_shape(max(longest, 1), raw=True):
        per_stream *= d
    per_stream *= g.core.dtype.itemsize
    return max(1, min(max_in_flight, GROUP_BYTES // max(1, per_stream)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _incomplete(r: StoreResult) -> str:
    if not r.chunks_total:
        return "the edit has fewer tokens than one chunk: nothing to store"
    return (f"store incomplete: {r.chunks_written} written, {r.chunks_already_cached} already "
            f"cached, {r.chunks_refused} refused of {r.chunks_total} chunks")
