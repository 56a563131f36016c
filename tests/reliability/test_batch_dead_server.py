"""A batch against a server that died or froze mid-batch (issue 19, item 10).

After an item's failure the batch pings the server once; when that gets no answer the
whole batch stops at once with ``ServerUnavailableError`` (its ``report`` counts the items
not attempted apart from the failed ones) instead of paying ``timeout`` per item: 24
items at ``timeout=2`` used to take ~48 s. Each test starts its own server (it is killed
or frozen) and checks that no batch thread outlives the batch and that the server's
segment is gone after it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import Model, make_model, rand_tokens

import lmcache_kv_fast as lkf
from lmcache_kv_fast import batch
from lmcache_kv_fast.batch import RewriteEngine
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.testing.server import lmcache_available

pytestmark = pytest.mark.skipif(not lmcache_available(), reason="needs the LMCache server")

C = 256
N = 24
TIMEOUT = 2.0
FAULT_AT = 4  # the edit of this item kills / freezes the server
#: an upper bound far below N * TIMEOUT: the in-flight items' timeouts, one ping, slack
BOUND_S = 5 * TIMEOUT + 4.0


@pytest.fixture
def dying_server() -> Iterator[LMCacheServer]:
    srv = LMCacheServer(shm=True, l1_size_gb=0.25)
    try:
        srv.start()
        yield srv
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGCONT)  # a frozen server must be able to stop
        srv.stop()
    assert not os.path.exists(f"/dev/shm/{srv.pool_segment}"), "server segment left"


def _seed(srv: LMCacheServer) -> tuple[Model, lkf.LMCacheKVCacheContext, list[list[int]]]:
    m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
    ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=TIMEOUT)
    seqs = [rand_tokens(2 * C, seed=1000 + i) for i in range(N)]
    for i, t in enumerate(seqs):
        assert ctx.store(m.kv(len(t), seed=i), t)
    return m, ctx, seqs


def _drop_half(kv: torch.Tensor, toks: list[int]) -> tuple[torch.Tensor, list[int]]:
    keep = [i for i in range(len(toks)) if i % 2 == 0]
    return kv.index_select(2, torch.tensor(keep)), [toks[i] for i in keep]


def _batch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lmcache-kv-batch")]


def _faulting_edit(srv: LMCacheServer, sig: int):
    calls = [0]

    def fn(kv: torch.Tensor, toks: list[int]) -> tuple[torch.Tensor, list[int]]:
        calls[0] += 1
        if calls[0] == FAULT_AT + 1:
            os.killpg(srv.proc.pid, sig)  # type: ignore[union-attr]
        return _drop_half(kv, toks)

    return fn


def _check_report(rep: batch.BatchReport) -> None:
    assert rep.items + rep.not_attempted == N, rep.summary()
    assert rep.missed == 0 and rep.cancelled == 0, rep.summary()
    assert rep.ok >= FAULT_AT - 1, rep.summary()  # items well before the fault were done
    # only what was in flight when the server went failed; the rest was not attempted
    assert 1 <= rep.failed <= 3, rep.summary()
    assert rep.not_attempted >= N - FAULT_AT - 4, rep.summary()
    failed = {e.index for e in rep.errors}
    skipped = set(rep.not_attempted_indices)
    assert len(skipped) == rep.not_attempted and not failed & skipped
    assert rep.not_attempted_indices == sorted(skipped)
    assert max(failed | skipped) == N - 1 and min(failed | skipped) >= FAULT_AT - 1
    assert "not attempted (server unavailable)" in rep.summary()


def test_rewrite_stops_at_once_when_the_server_is_killed(dying_server: LMCacheServer) -> None:
    srv = dying_server
    _, ctx, seqs = _seed(srv)
    try:
        t0 = time.monotonic()
        with pytest.raises(lkf.ServerUnavailableError, match="unavailable") as ei:
            batch.rewrite(ctx, seqs, _faulting_edit(srv, signal.SIGKILL), progress=False)
        took = time.monotonic() - t0
        assert took < BOUND_S, f"{took:.1f}s: the batch paid the timeout per item"
        assert isinstance(ei.value, lkf.KVCacheSDKError)
        rep = ei.value.report
        assert isinstance(rep, batch.BatchReport)
        _check_report(rep)
        assert _batch_threads() == []
    finally:
        t0 = time.monotonic()
        ctx.close()
        assert time.monotonic() - t0 < TIMEOUT + 6.0


def test_rewrite_stops_on_a_frozen_server_and_resumes_after_sigcont(
        dying_server: LMCacheServer) -> None:
    srv = dying_server
    m, ctx, seqs = _seed(srv)
    fn = _faulting_edit(srv, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(lkf.ServerUnavailableError) as ei:
            batch.rewrite(ctx, seqs, fn, progress=False)
        took = time.monotonic() - t0
        assert took < BOUND_S, f"{took:.1f}s: the batch paid the timeout per item"
        rep = ei.value.report
        _check_report(rep)
        assert _batch_threads() == []
        os.killpg(srv.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        # the server is back: the verdict was this batch's; the items not attempted and
        # the failed ones are rewritten by a new batch on the same context
        redo = sorted(set(rep.not_attempted_indices) | {e.index for e in rep.errors})
        rep2 = batch.rewrite(ctx, [seqs[i] for i in redo], _drop_half, progress=False)
        assert rep2.ok == len(redo), rep2.summary()
        for i in (0, *redo):
            new_kv, new = _drop_half(m.kv(2 * C, seed=i), seqs[i])
            got = ctx.retrieve(new)
            assert got is not None and torch.equal(got, new_kv), i
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGCONT)
        ctx.close()


def test_a_failure_on_a_live_server_does_not_stop_the_batch(dying_server: LMCacheServer) -> None:
    """One item's timeout with the server still answering: one ping, and the batch goes on."""
    srv = dying_server
    _, ctx, seqs = _seed(srv)

    def fetch(c: lkf.LMCacheKVCacheContext, toks: list[int]):
        if toks is seqs[2]:
            raise lkf.ServerTimeoutError("injected: no reply in time")
        return c.retrieve(toks), toks

    try:
        rep = RewriteEngine(ctx, _drop_half, fetch=fetch).run(seqs[:6])
        assert (rep.ok, rep.failed, rep.not_attempted) == (5, 1, 0), rep.summary()
        assert rep.errors[0].index == 2 and "ServerTimeoutError" in rep.errors[0].reason
        assert _batch_threads() == []
    finally:
        ctx.close()


def test_fused_rewrite_stops_at_once_when_the_server_is_killed(
        dying_server: LMCacheServer) -> None:
    """A library edit (slot to slot) whose planning kills the server mid-batch."""
    from dataclasses import dataclass

    from lmcache_kv_fast import edits
    from lmcache_kv_fast.edits._positional import DropEvery

    srv = dying_server
    calls = [0]

    @dataclass(frozen=True)
    class KillingDrop(DropEvery):
        def positional(self, count: int) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == FAULT_AT + 1:
                os.killpg(srv.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            return super().positional(count)

    fn = KillingDrop(k=2)
    assert edits.plannable(fn)
    _, ctx, seqs = _seed(srv)
    try:
        t0 = time.monotonic()
        with pytest.raises(lkf.ServerUnavailableError, match="unavailable") as ei:
            batch.rewrite(ctx, seqs, fn, progress=False)
        assert time.monotonic() - t0 < BOUND_S, "the batch paid the timeout per item"
        rep = ei.value.report
        assert rep.fused >= FAULT_AT - 1 and rep.tensor == 0, rep.summary()
        _check_report(rep)
        assert _batch_threads() == []
    finally:
        t0 = time.monotonic()
        ctx.close()
        assert time.monotonic() - t0 < TIMEOUT + 6.0
