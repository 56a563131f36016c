"""Deferred retrieve commits (transport/releases.py) against the real server.

A retrieve returns before the server acknowledged its ``commit_retrieve``; the session ends
after the acknowledgement. Nothing may be left behind, identical keys on other threads
must not collide with an unacknowledged commit, and ``clear`` must see the locks gone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import make_model, rand_tokens, run_threads

import lmcache_kv_fast.kvcache as lmc_sdk

C = 256


def _left(server) -> tuple[int, int, int]:
    st = server.settled_status()
    l1 = st["storage_manager"]["l1_manager"]
    return st["active_sessions"], st["active_prefetch_jobs"], l1["read_locked_count"]


@pytest.mark.parametrize("heartbeat", [True, False])
def test_idle_after_retrieve_leaves_nothing(server, model, heartbeat):
    """The background thread ends the session although the caller makes no further call."""
    toks = rand_tokens(3 * C, seed=21)
    kv = model.kv(3 * C, 21)
    with lmc_sdk.connect(server.url, server.http_url, model.name, heartbeat=heartbeat) as ctx:
        assert ctx.store(kv, toks)
        for _ in range(3):
            assert torch.equal(ctx.retrieve(toks), kv)
        assert ctx.last_timing.rpcs >= 3  # lookup, wait(s), prepare; the commit: deferred
        assert _left(server) == (0, 0, 0)  # while the context stays open and idle
        rel = ctx._releases
        assert rel is not None
        deadline = time.monotonic() + 2.0  # the background thread collects the last replies
        while rel.pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not rel.pending()
        bg = ctx._hb_thread
        assert bg is not None and bg.is_alive()  # started lazily without the heartbeat too
    assert not bg.is_alive()  # close() stopped it


def test_identical_keys_across_threads(server, model):
    """Identical retrieves (and stores) racing on threads: every lock and session released."""
    toks = rand_tokens(2 * C, seed=22)
    kv = model.kv(2 * C, 22)
    with lmc_sdk.connect(server.url, server.http_url, model.name) as ctx:
        assert ctx.store(kv, toks)

        def worker(i: int) -> None:
            for j in range(25):
                if (i + j) % 5 == 0:
                    assert ctx.store(kv, toks)  # already cached: a no-op write
                got = ctx.retrieve(toks)
                assert got is not None and torch.equal(got, kv)

        errors = run_threads(worker, 3)
        assert not errors, errors[0]
        assert _left(server) == (0, 0, 0)


def test_clear_right_after_retrieve_clears(server, model):
    """clear() waits for the read locks of finished retrieves: nothing survives it."""
    toks = rand_tokens(2 * C, seed=23)
    kv = model.kv(2 * C, 23)
    with lmc_sdk.connect(server.url, server.http_url, model.name) as ctx:
        for _ in range(3):
            assert ctx.store(kv, toks)
            assert ctx.retrieve(toks) is not None
            ctx.clear()  # unforced: it would skip read-locked objects
            assert ctx.lookup(toks) == 0


def test_close_right_after_retrieve_leaves_nothing(server, model):
    toks = rand_tokens(C, seed=24)
    kv = model.kv(C, 24)
    ctx = lmc_sdk.connect(server.url, server.http_url, model.name)
    try:
        assert ctx.store(kv, toks)
        out = torch.empty_like(kv)
        ctx.retrieve(toks, out=out)
        assert torch.equal(out, kv)
    finally:
        ctx.close()
    st = server.status()  # no settling: close() already waited for every release
    assert st["active_sessions"] == 0
    assert st["storage_manager"]["l1_manager"]["read_locked_count"] == 0


def test_hung_server_bounds_every_wait():
    """A stopped server never acknowledges: settle and same-key waits give up in time."""
    from lmcache_kv_fast.errors import ServerTimeoutError
    from lmcache_kv_fast.testing.server import LMCacheServer

    with LMCacheServer(l1_size_gb=0.5) as srv:
        m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
        toks = rand_tokens(C, seed=25)
        kv = m.kv(C, 25)
        ctx = lmc_sdk.connect(srv.url, srv.http_url, m.name, timeout=3)
        try:
            assert ctx.store(kv, toks)
            assert ctx.retrieve(toks) is not None
            rel = ctx._releases
            assert rel is not None and rel.settle(3.0)
            os.killpg(srv.proc.pid, signal.SIGSTOP)
            try:
                key = ("", tuple(toks))
                rel.commit([[ctx._key(toks, 0, C, "kvf-test-hung", "", 0), ctx.instance_id]],
                           "kvf-test-hung", key)
                assert rel.busy(key) and rel.pending()
                t0 = time.monotonic()
                assert not rel.settle(0.3)
                with pytest.raises(ServerTimeoutError, match="not acknowledged"):
                    rel.wait_key(key, 0.3)
                assert time.monotonic() - t0 < 3.0
            finally:
                os.killpg(srv.proc.pid, signal.SIGCONT)
            assert rel.settle(5.0) and not rel.busy(key)
            assert ctx.retrieve(toks) is not None  # the same key goes through again
        finally:
            ctx.close()
        assert _left(srv) == (0, 0, 0)


def test_awaited_flow_still_works(server, model):
    """The awaited release flow (benches/bench_release.py's baseline) leaves nothing either."""
    toks = rand_tokens(2 * C, seed=26)
    kv = model.kv(2 * C, 26)
    with lmc_sdk.connect(server.url, server.http_url, model.name) as ctx:
        ctx._defer_releases = False
        assert ctx.store(kv, toks)
        for _ in range(3):
            assert torch.equal(ctx.retrieve(toks), kv)
        assert ctx.last_timing.rpcs >= 4  # the commit's reply is waited for
        assert ctx._releases is None
        assert _left(server) == (0, 0, 0)


def test_pending_never_reads_false_between_commit_ack_and_end(server, model):
    """The collector thread sleeps once nothing is pending: the hand-over from a commit's
    acknowledgement to its end_session must never look like "nothing pending"."""
    from lmcache_kv_fast.protocol.ops import Op

    toks = rand_tokens(C, seed=27)
    kv = model.kv(C, 27)
    with lmc_sdk.connect(server.url, server.http_url, model.name) as ctx:
        assert ctx.store(kv, toks)
        assert ctx.retrieve(toks) is not None  # creates the release channel
        rel = ctx._releases
        assert rel is not None and rel.settle(5.0)
        ch = rel._channel()
        seen: list[bool] = []
        real_fire = ch.fire

        def fire(op, payloads=(), **kw):
            if op is Op.END_SESSION:
                seen.append(rel.pending())
            return real_fire(op, payloads, **kw)

        ch.fire = fire
        for _ in range(20):
            assert ctx.retrieve(toks) is not None
        assert rel.settle(5.0)
        assert len(seen) == 20 and all(seen), seen
        assert _left(server) == (0, 0, 0)
