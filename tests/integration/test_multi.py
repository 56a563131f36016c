"""client/multi.py against the real server: many sequences with pipelined requests.

Results equal the one-sequence calls', nothing is left on the server (sessions, prefetch
jobs, read locks), a key given twice goes through, and on a frozen server every sequence
fails alone within about one timeout, its late replies settled like a single call's.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import make_model, rand_tokens

import lmcache_kv_fast as lkf
from lmcache_kv_fast.client.multi import MultiIO
from lmcache_kv_fast.errors import InvalidArgumentError, KVCacheSDKError, ServerTimeoutError
from lmcache_kv_fast.results import StoreResult
from lmcache_kv_fast.testing.server import LMCacheServer

C = 256


def _left(server) -> tuple[int, int, int]:
    st = server.settled_status()
    l1 = st["storage_manager"]["l1_manager"]
    return st["active_sessions"], st["active_prefetch_jobs"], l1["read_locked_count"]


def test_many_equal_single_calls_and_leave_nothing(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    lens = [3 * C, 2 * C + 100, C, 4 * C, 100]  # the last: less than a chunk
    toks = [rand_tokens(n, seed=300 + i) for i, n in enumerate(lens)]
    kvs = [m.kv(n, 300 + i) for i, n in enumerate(lens)]
    with lkf.connect(server_shm.url, server_shm.http_url, m.name) as ctx, MultiIO(ctx) as io:
        assert io.supported
        res = io.store_many(kvs, toks, ["s"] * len(lens))
        assert [r.tokens_stored for r in res] == [n // C * C for n in lens]
        assert all(r.ok for r in res[:4]) and res[4] == StoreResult(0, 0, 0, 0, 0)
        again = io.store_many(kvs[:2], toks[:2], ["s", "s"])  # already cached: as store_ex
        assert again == [ctx.store_ex(kvs[i], toks[i], "s") for i in range(2)]
        outs = [torch.full(ctx.kv_shape(n), 7.0, dtype=ctx.dtype) for n in lens]
        got = io.retrieve_many(toks, ["s"] * len(lens), outs)
        for i, n in enumerate(lens[:4]):
            whole = n // C * C
            assert got[i].data_ptr() == outs[i].data_ptr()
            assert torch.equal(got[i], kvs[i][:, :, :whole])
            assert torch.equal(got[i], ctx.retrieve(toks[i], "s"))
        assert got[4] is None
        # a miss, another salt, a longer sequence (hit = the stored prefix), the same key twice
        longer = toks[0] + rand_tokens(C, seed=399)
        probe = [rand_tokens(2 * C, seed=398), toks[0], longer, toks[3], toks[3]]
        outs = [torch.empty(ctx.kv_shape(len(t)), dtype=ctx.dtype) for t in probe]
        got = io.retrieve_many(probe, ["s", "other", "s", "s", "s"], outs)
        assert got[0] is None and got[1] is None
        assert torch.equal(got[2], kvs[0])
        assert torch.equal(got[3], kvs[3]) and torch.equal(got[4], kvs[3])
        # started, then other work, then finished
        pr = io.start_retrieve([toks[1]], ["s"], [outs[0][:, :, : 2 * C]])
        assert io.store_many([kvs[2]], [toks[2]], ["s"])[0].ok
        assert torch.equal(io.finish_retrieve(pr)[0], kvs[1][:, :, : 2 * C])
        assert io.finish_retrieve(pr)[0] is not None  # finished once, answered again
        with pytest.raises(InvalidArgumentError, match="same length"):
            io.retrieve_many(toks, ["s"], outs)
        with pytest.raises(InvalidArgumentError, match="len.tokens"):
            io.store_many([kvs[0]], [toks[1]], ["s"])
    assert _left(server_shm) == (0, 0, 0)


def test_pickle_plane_is_not_supported(server_pickle):
    m = make_model(server_pickle, num_layers=2, num_kv_heads=2, head_size=64)
    with lkf.connect(server_pickle.url, server_pickle.http_url, m.name) as ctx:
        io = MultiIO(ctx)
        assert not io.supported
        io.close()


def test_frozen_server_every_sequence_fails_alone_and_is_settled():
    with LMCacheServer(shm=True, l1_size_gb=0.5) as srv:
        m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
        toks = [rand_tokens(2 * C, seed=310 + i) for i in range(4)]
        kvs = [m.kv(2 * C, 310 + i) for i in range(4)]
        ctx = lkf.connect(srv.url, srv.http_url, m.name, timeout=2)
        try:
            with MultiIO(ctx) as io:
                assert all(r.ok for r in io.store_many(kvs[:2], toks[:2], ["", ""]))
                outs = [torch.empty(ctx.kv_shape(2 * C), dtype=ctx.dtype) for _ in range(2)]
                os.kill(srv.proc.pid, signal.SIGSTOP)
                try:
                    t0 = time.monotonic()
                    got = io.retrieve_many(toks[:2], ["", ""], outs)
                    stored = io.store_many(kvs[2:], toks[2:], ["", ""])
                    took = time.monotonic() - t0
                finally:
                    os.kill(srv.proc.pid, signal.SIGCONT)
                assert all(isinstance(r, ServerTimeoutError) for r in got + stored), got + stored
                assert took < 2 * 2.0 + 4 * 0.5 + 2.0  # one timeout per group, then short waits
                assert ctx._session.late.settle(10.0)  # late replies: locks freed, stores filled
                # the stores' late reservations were filled from their snapshots
                for t, kv in zip(toks, kvs, strict=True):
                    assert torch.equal(ctx.retrieve(t), kv)
                again = io.retrieve_many(toks, [""] * 4, [torch.empty(ctx.kv_shape(2 * C),
                                                                      dtype=ctx.dtype)
                                                          for _ in range(4)])
                assert all(torch.equal(g, kv) for g, kv in zip(again, kvs, strict=True))
        finally:
            ctx.close()
        assert _left(srv) == (0, 0, 0)


def test_a_closed_context_fails_the_call(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    ctx = lkf.connect(server_shm.url, server_shm.http_url, m.name)
    io = MultiIO(ctx)
    ctx.close()
    with pytest.raises(KVCacheSDKError, match="closed"):
        io.store_many([m.kv(C)], [rand_tokens(C)], [""])
    io.close()
