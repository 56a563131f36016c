"""Integrity under faults: no wrong byte ever becomes visible (issue 19).

Against real servers, checking the BYTES another client reads (the KV that was given, or
a miss), not only lock counts:

* a store that times out on a frozen server (SIGSTOP, then SIGCONT), or whose
  ``prepare_store`` / ``commit_store`` the server runs late (a proxy holds the request),
  is finished late with exactly the KV given (from a snapshot: the caller may reuse its
  buffer), or never becomes visible;
* lookups, retrieves and batches that time out release every lock and session they took
  once the late replies come (at the latest in ``close()``);
* contexts dropped without ``close()`` are collected and closed.

The slow reaper cases (a client SIGKILLed mid-store, or before its first heartbeat) are
in ``test_faults.py``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import Model, make_model, rand_tokens, start_server
from delay_proxy import DelayProxy
from rel_helpers import install_frame_watch, leftovers, wait_until

import lmcache_kv_fast as lkf
from lmcache_kv_fast import batch
from lmcache_kv_fast.client import late
from lmcache_kv_fast.testing import LMCacheServer

C = 256
TIMEOUT = 1.5  # operations through the holding proxy
FROZEN_TIMEOUT = 2.0  # operations on a SIGSTOPped server (close() settles for as long)

install_frame_watch()


@pytest.fixture(scope="module")
def srv() -> Iterator[LMCacheServer]:
    yield from start_server(True, l1_size_gb=0.5)


@contextlib.contextmanager
def frozen(s: LMCacheServer) -> Iterator[None]:
    """SIGSTOP the server for the block; SIGCONT after it (also on failure)."""
    assert s.proc is not None
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)


def _regs(s: LMCacheServer) -> set[str]:
    return set(s.status().get("non_cuda_context_meta") or {})


def _reads_back(s: LMCacheServer, m: Model, toks: list[int], kv: torch.Tensor) -> None:
    """Another client reads exactly ``kv`` under ``toks``."""
    with lkf.connect(s.url, s.http_url, m.name, timeout=10) as other:
        got = other.retrieve(toks)
        assert got is not None, "the late store never became visible"
        assert got.shape == kv.shape and torch.equal(got, kv), "visible bytes are not the KV"


def _invisible(s: LMCacheServer, m: Model, toks: list[int]) -> None:
    with lkf.connect(s.url, s.http_url, m.name, timeout=10) as other:
        assert other.lookup(toks) == 0
        assert other.retrieve(toks) is None


@pytest.fixture
def base(srv: LMCacheServer) -> dict[str, int]:
    """The server's leftovers before the test (a pinned reservation of an earlier test stays
    staged until its write TTL)."""
    return leftovers(srv)


def _clean(s: LMCacheServer, base: dict[str, int]) -> None:
    """Nothing left beyond ``base``: no session, prefetch job, lock or staged object."""
    deadline = time.monotonic() + 10
    while True:
        left = leftovers(s)
        if left == base or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == base, (left, base)


# ----------------------------------------------------------------------- stores (item 1)
def test_store_on_frozen_server_commits_the_given_kv_late(srv: LMCacheServer, base: dict[str, int]) -> None:
    """SIGSTOP > timeout: store raises; after SIGCONT the server still reserves; the SDK
    fills the reservation with the KV given (though the caller scribbled over its tensor)
    and commits it; close() settles it and unregisters both instances."""
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(4 * C, seed=1), m.kv(4 * C, seed=1)
    given = kv.clone()
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=FROZEN_TIMEOUT)
    ids = {str(ctx.instance_id), str(ctx.writer_instance_id)}
    assert len(ids) == 2 and ids <= _regs(srv)
    try:
        with frozen(srv):
            with pytest.raises(lkf.ServerTimeoutError):
                ctx.store(kv, toks)
            kv.fill_(0)  # the caller reuses its buffer after the failure
    finally:
        ctx.close()
    assert not ids & _regs(srv), "a registration outlived close()"
    _reads_back(srv, m, toks, given)
    _clean(srv, base)


def test_late_store_finishes_in_the_background(srv: LMCacheServer, base: dict[str, int]) -> None:
    """prepare_store runs after the client gave up (held by a proxy): the context keeps
    working, and the late reservation is filled with the given KV without any call."""
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(2 * C, seed=2), m.kv(2 * C, seed=2)
    given = kv.clone()
    with DelayProxy(srv.url) as px, \
            lkf.connect(px.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
        px.hold("prepare_store")
        with pytest.raises(lkf.ServerTimeoutError):
            ctx.store(kv, toks)
        kv.fill_(1)
        assert px.held() == ["prepare_store"]
        px.release()
        # visible soon, with the right bytes, while the context stays open and idle
        assert wait_until(lambda: ctx.lookup(toks) == 2 * C, timeout=10, step=0.05)
        _reads_back(srv, m, toks, given)
        # an identical store now is "already cached"; other work goes on
        res = ctx.store_ex(given, toks)
        assert res.ok and res.chunks_already_cached == 2
        toks2, kv2 = rand_tokens(C, seed=3), m.kv(C, seed=3)
        assert ctx.store(kv2, toks2)
        assert torch.equal(ctx.retrieve(toks2), kv2)
    _clean(srv, base)


def test_late_store_of_a_fused_rewrite_gets_the_edit(srv: LMCacheServer,
                                                     base: dict[str, int]) -> None:
    """A fused rewrite whose prepare_store is answered late: the reservation is filled
    from a snapshot the tensor edit made while the reads were still locked."""
    from lmcache_kv_fast import edits

    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(3 * C, seed=12), m.kv(3 * C, seed=12)
    fn = edits.drop_every(3)
    want, new = fn(kv, toks)
    with DelayProxy(srv.url) as px, \
            lkf.connect(px.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
        assert ctx.store(kv, toks)
        px.hold("prepare_store")
        rep = batch.rewrite(ctx, [toks], fn, progress=False)
        assert rep.failed == 1 and rep.errors[0].stage == "store", rep.summary()
        assert "Timeout" in rep.errors[0].reason
        px.release()
        assert wait_until(lambda: ctx.lookup(new) == 2 * C, timeout=10, step=0.05)
        _reads_back(srv, m, new[: 2 * C], want[:, :, : 2 * C].contiguous())
    _clean(srv, base)


def test_late_commit_is_settled(srv: LMCacheServer, base: dict[str, int]) -> None:
    """commit_store runs after the client gave up: store() says False (verified by
    lookup: not cached yet); the data (written in full) becomes visible late; the writer
    is unregistered at close once the commit was answered."""
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(3 * C, seed=4), m.kv(3 * C, seed=4)
    with DelayProxy(srv.url) as px:
        ctx = lkf.connect(px.url, srv.http_url, m.name, timeout=TIMEOUT)
        wid = str(ctx.writer_instance_id)
        try:
            px.hold("commit_store")
            assert ctx.store(kv, toks) is False  # not cached when it returns (verified)
            px.release()
        finally:
            ctx.close()
    assert wid not in _regs(srv)
    _reads_back(srv, m, toks, kv)
    _clean(srv, base)


def test_late_reservation_without_snapshot_is_never_admitted(
        srv: LMCacheServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the snapshot budget the late reservation cannot be filled: it is never
    committed and close() keeps the writer registered (unregistering would admit it);
    nothing of it is ever visible. (The server reaps that writer after its registration
    grace, when the write TTL has expired: test_faults.py checks that.)"""
    monkeypatch.setattr(late, "SNAPSHOT_BUDGET_BYTES", 0)
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(2 * C, seed=5), m.kv(2 * C, seed=5)
    with DelayProxy(srv.url) as px:
        ctx = lkf.connect(px.url, srv.http_url, m.name, timeout=TIMEOUT)
        rid, wid = str(ctx.instance_id), str(ctx.writer_instance_id)
        try:
            px.hold("prepare_store")
            with pytest.raises(lkf.ServerTimeoutError):
                ctx.store(kv, toks)
            px.release()
            assert wait_until(lambda: leftovers(srv)["write_locked_count"] >= 2, timeout=10,
                              step=0.05)
        finally:
            ctx.close()
    regs = _regs(srv)
    assert rid not in regs and wid in regs  # the reader goes, the writer stays (pinned)
    _invisible(srv, m, toks)
    assert leftovers(srv)["write_locked_count"] >= 2  # staged, invisible, until its TTL


def test_rewrite_on_frozen_server_leaves_no_wrong_bytes(srv: LMCacheServer, base: dict[str, int]) -> None:
    """batch.rewrite while the server freezes (SIGSTOP from inside the edit of the first
    sequence, SIGCONT a few seconds later): each item fails or lands; after close() every
    target holds exactly its edited KV or nothing, the first one (whose store timed out)
    its edited KV, and no registration of the context is left to be reaped."""
    m = make_model(srv, num_layers=2)
    seqs = [rand_tokens(2 * C, seed=100 + i) for i in range(4)]
    kvs = [m.kv(2 * C, seed=100 + i) for i in range(4)]
    edited = {tuple(t): kv * 2 for t, kv in zip(seqs, kvs, strict=True)}
    assert srv.proc is not None
    pid = srv.proc.pid
    # frozen well past the timeout: the first store fails; the liveness ping after it may
    # find the server frozen too (then the batch stops early: item 10), either is right
    thaw = threading.Timer(3 * FROZEN_TIMEOUT, os.kill, (pid, signal.SIGCONT))
    first = []

    def fn(kv: torch.Tensor, toks: list[int]) -> tuple[torch.Tensor, list[int]]:
        if not first:
            first.append(tuple(toks))
            os.kill(pid, signal.SIGSTOP)
            thaw.start()
        return kv * 2, [t + 1 for t in toks]

    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=FROZEN_TIMEOUT)
    ids = {str(ctx.instance_id), str(ctx.writer_instance_id)}
    try:
        for t, kv in zip(seqs, kvs, strict=True):
            assert ctx.store(kv, t)
        try:
            report = batch.rewrite(ctx, seqs, fn, workers=2, progress=False)
        except lkf.ServerUnavailableError as err:  # the ping after the timeout found it frozen
            report = err.report
        assert report.items + report.not_attempted == 4 and report.failed >= 1, \
            report.summary()
    finally:
        if first:
            thaw.join(30)
        os.kill(pid, signal.SIGCONT)
        ctx.close()
    assert not ids & _regs(srv), "a registration outlived close(): it could be reaped"
    with lkf.connect(srv.url, srv.http_url, m.name, timeout=10) as other:
        for t, want in edited.items():
            got = other.retrieve([x + 1 for x in t])
            assert got is None or torch.equal(got, want), "wrong bytes visible"
            if t == first[0]:
                assert got is not None, "the timed-out store was not finished late"
    _clean(srv, base)


# ------------------------------------------------------------------ reads (item 11)
def test_frozen_reads_release_every_lock_and_session(srv: LMCacheServer, base: dict[str, int]) -> None:
    """Lookup, retrieve and retrieve_many time out on a frozen server; after SIGCONT and
    close(), no read lock and no session is left on the server."""
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(3 * C, seed=6), m.kv(3 * C, seed=6)
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=FROZEN_TIMEOUT)
    try:
        assert ctx.store(kv, toks)
        _clean(srv, base)
        with frozen(srv):
            with pytest.raises(lkf.ServerTimeoutError):
                ctx.retrieve(toks)
            with pytest.raises(lkf.ServerTimeoutError):
                ctx.lookup(toks)
            rep = batch.BatchReport()
            got = list(batch.retrieve_many(ctx, [toks, toks], report=rep, workers=2))
            assert [v for _, v in got] == [None, None] and rep.failed == 2, rep.summary()
    finally:
        ctx.close()
    _clean(srv, base)
    _reads_back(srv, m, toks, kv)


def test_late_prepare_retrieve_is_committed(srv: LMCacheServer, base: dict[str, int]) -> None:
    """prepare_retrieve runs after the client gave up: its pending reads are committed
    (not its lookup locks freed blindly, which would release a lock twice once the late
    prepare ran); nothing is left, and the context keeps working meanwhile."""
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(2 * C, seed=7), m.kv(2 * C, seed=7)
    with DelayProxy(srv.url) as px, \
            lkf.connect(px.url, srv.http_url, m.name, timeout=TIMEOUT) as ctx:
        assert ctx.store(kv, toks)
        px.hold("prepare_retrieve")
        with pytest.raises(lkf.ServerTimeoutError):
            ctx.retrieve(toks)
        assert leftovers(srv)["read_locked_count"] >= 1  # the lookup's locks, still held
        px.release()
        assert wait_until(lambda: leftovers(srv) == base, timeout=10, step=0.05)
        assert torch.equal(ctx.retrieve(toks), kv)
    _clean(srv, base)


# ------------------------------------------------------------------- GC (item 13)
def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_dropped_contexts_are_collected_and_closed(srv: LMCacheServer, base: dict[str, int]) -> None:
    """30 contexts dropped without close(): collected, closed and unregistered; threads,
    fds and server registrations back to where they were."""
    m = make_model(srv, num_layers=2)
    toks, kv = rand_tokens(C, seed=8), m.kv(C, seed=8)
    gc.collect()
    time.sleep(0.2)
    threads0, fds0, regs0 = _os_threads(), _fds(), _regs(srv)
    for i in range(30):
        ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=10)
        if i % 3 == 0:  # some did work (deferred releases, background thread running)
            assert ctx.store(kv, toks)
            assert ctx.retrieve(toks) is not None
        del ctx
    gc.collect()
    ok = wait_until(lambda: _os_threads() <= threads0 and _fds() <= fds0 and
                    _regs(srv) == regs0, timeout=20, step=0.2)
    assert ok, (f"threads {_os_threads()} (was {threads0}), fds {_fds()} (was "
                f"{fds0}), registrations {len(_regs(srv))} (was {len(regs0)})")
    _clean(srv, base)
