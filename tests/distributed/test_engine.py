"""The per-actor item engine on a real server, in-process (no Ray cluster needed)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, rand_tokens
from fleet_helpers import drop_every_4th, whole

from lmcache_kv_fast import batch, connect

pytest.importorskip("ray", reason="lmcache_kv_fast.distributed needs Ray")

from lmcache_kv_fast.distributed._engine import ItemEngine

pytestmark = pytest.mark.distributed


@pytest.fixture
def setup(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=64)
    ctx = connect(server_shm.url, server_shm.http_url, m.name, timeout=20.0)
    eng = ItemEngine(ctx, max_in_flight=2)
    yield m, ctx, eng
    eng.close()
    ctx.close()


def _seed(m, ctx, n: int, seed: int):
    c = ctx.chunk_size
    seqs = [rand_tokens(2 * c + 3, seed=seed + k) for k in range(n)]
    kvs = [m.kv(len(t), seed=seed + k) for k, t in enumerate(seqs)]
    for kv, t in zip(kvs, seqs):
        assert ctx.store(kv, t)
    return seqs, kvs


def test_engine_matches_batch_rewrite_and_reports_like_it(setup):
    m, ctx, eng = setup
    seqs, _ = _seed(m, ctx, 4, 100)
    seqs2 = [list(t) for t in seqs]
    outs = eng.run("rewrite", list(enumerate([*seqs, rand_tokens(40, seed=1), [1, -5]])),
                   fn=drop_every_4th)
    assert [o.status for o in outs] == ["ok"] * 4 + ["missed", "failed"]
    assert outs[4].stage == "retrieve" and outs[5].stage == "retrieve"
    ref = m.server  # a second model with the same data, rewritten by batch.rewrite
    m2 = make_model(ref, num_layers=2, num_kv_heads=2, head_size=64)
    with connect(ref.url, ref.http_url, m2.name, timeout=20.0) as ctx2:
        for k, t in enumerate(seqs2):
            assert ctx2.store(m.kv(len(t), seed=100 + k), t)
        rep = batch.rewrite(ctx2, seqs2, drop_every_4th, progress=False)
        assert rep.tokens_moved == sum(o.tokens for o in outs)
        assert rep.bytes_moved == sum(o.nbytes for o in outs)
        c = ctx.chunk_size
        for t in seqs:
            new = whole(drop_every_4th(torch.zeros(1, len(t), 1), t)[1], c)
            assert torch.equal(ctx.retrieve(new), ctx2.retrieve(new))
    assert eng.lookup_many([seqs[0], rand_tokens(600, seed=3)]) == [2 * ctx.chunk_size, 0]


def test_library_edits_go_slot_to_slot_with_hashes(setup):
    """A library edit's rewrite item takes the fused path (no verify): same bytes, hashes."""
    from lmcache_kv_fast import edits
    from lmcache_kv_fast.hashing import chunk_hashes

    m, ctx, eng = setup
    c = ctx.chunk_size
    seqs, kvs = _seed(m, ctx, 3, 400)
    fn = edits.drop_every(4)
    outs = eng.run("rewrite", list(enumerate(seqs)), fn=fn, want_hashes=True)
    assert [o.status for o in outs] == ["ok"] * 3, outs
    assert eng._rw.fused.takes(fn)
    for o, t, kv in zip(outs, seqs, kvs):
        want, new = fn(kv[:, :, : 2 * c].contiguous(), t[: 2 * c])
        n = len(new) // c * c
        assert o.hashes == chunk_hashes(new[:n], c)
        assert torch.equal(ctx.retrieve(new).view(torch.int16), want[:, :, :n].view(torch.int16))


def test_retry_verification_refuses_to_mix_results(setup):
    m, ctx, eng = setup
    c = ctx.chunk_size
    seqs, kvs = _seed(m, ctx, 2, 200)
    # seqs[0]: an earlier attempt stored the same result -> the retry verifies and succeeds
    new_kv, new = drop_every_4th(kvs[0][..., : 2 * c, :], seqs[0][: 2 * c])
    assert ctx.store(new_kv[..., :c, :], new[:c])
    # seqs[1]: an earlier attempt stored *another* result for the first output chunk
    _, new1 = drop_every_4th(kvs[1][..., : 2 * c, :], seqs[1][: 2 * c])
    assert ctx.store(m.kv(c, seed=999), new1[:c])
    outs = eng.run("rewrite", [(0, seqs[0]), (1, seqs[1])], fn=drop_every_4th, verify=True)
    assert outs[0].status == "ok" and outs[0].stages["verify"] > 0
    assert (outs[1].status, outs[1].stage) == ("failed", "verify")
    assert "conflict" in outs[1].reason and "nothing of this attempt was stored" in outs[1].reason
    # nothing was added to the mixed output; the first chunk kept the earlier content
    assert ctx.lookup(new1) == c


def test_store_and_retrieve_items_and_hashes(setup):
    m, ctx, eng = setup
    c = ctx.chunk_size
    toks = rand_tokens(2 * c, seed=300)
    kv = m.kv(2 * c, seed=300)
    [o] = eng.run("store", [(7, (kv, toks))], want_hashes=True)
    assert (o.index, o.status, o.tokens) == (7, "ok", 2 * c)
    from lmcache_kv_fast.hashing import chunk_hashes

    assert o.hashes == chunk_hashes(toks, c)
    [r, miss] = eng.run("retrieve", [(0, toks), (1, rand_tokens(c, seed=301))])
    assert torch.equal(r.value, kv) and miss.status == "missed" and miss.value is None
    [bad] = eng.run("store", [(0, "not a pair")])
    assert bad.status == "failed" and bad.stage == "store"
    with pytest.raises(ValueError, match="op must be"):
        eng.submit("drop", 0, toks)
    with pytest.raises(ValueError, match="callable"):
        eng.submit("rewrite", 0, toks)


def test_rewrite_items_run_on_batch_rewrites_engine(setup):
    """One engine underneath: the actor's rewrite items run on batch.rewrite's RewriteEngine
    (its edit thread, its alloc pool for an fn that takes alloc), fed item by item."""
    import threading

    from lmcache_kv_fast.batch import RewriteEngine

    m, ctx, eng = setup
    assert isinstance(eng._rw, RewriteEngine)
    seqs, kvs = _seed(m, ctx, 3, 400)
    threads: list[str] = []

    def plain(kv, toks):
        threads.append(threading.current_thread().name)
        return drop_every_4th(kv, toks)

    def with_alloc(kv, toks, *, alloc):
        threads.append(threading.current_thread().name)
        new_kv, new_toks = drop_every_4th(kv, toks)
        out = alloc(tuple(new_kv.shape), new_kv.dtype)
        out.copy_(new_kv)
        return out, new_toks

    outs = eng.run("rewrite", [(0, seqs[0]), (1, seqs[1])], fn=plain)
    outs += eng.run("rewrite", [(2, seqs[2])], fn=with_alloc)
    assert [o.status for o in outs] == ["ok"] * 3, outs
    assert [o.index for o in outs] == [0, 1, 2]
    assert threads and all(t.startswith("lmcache-kv-batch-edit") for t in threads), threads
    c = ctx.chunk_size
    for t, kv in zip(seqs, kvs):
        want_kv, new = drop_every_4th(kv[..., : 2 * c, :], t[: 2 * c])
        n = len(new) // c * c
        got = ctx.retrieve(new[:n])
        assert got is not None and torch.equal(got, want_kv[..., :n, :])


def test_rewrite_items_stop_at_once_when_the_server_dies():
    """The actor's rewrite items share batch.rewrite's liveness check: after an item's
    failure one ping; the server gone, queued items fail at once as not attempted instead
    of paying the timeout each."""
    import os
    import signal
    import threading
    import time

    from lmcache_kv_fast.testing import LMCacheServer

    srv = LMCacheServer(shm=True, l1_size_gb=0.25)
    try:
        srv.start()
        m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
        ctx = connect(srv.url, srv.http_url, m.name, timeout=2.0)
        seqs, _ = _seed(m, ctx, 12, 500)
        calls = [0]

        def killing(kv, toks):
            calls[0] += 1
            if calls[0] == 3:
                os.killpg(srv.proc.pid, signal.SIGKILL)
            return drop_every_4th(kv, toks)

        eng = ItemEngine(ctx, max_in_flight=4)
        try:
            t0 = time.monotonic()
            outs = eng.run("rewrite", list(enumerate(seqs)), fn=killing)
            took = time.monotonic() - t0
        finally:
            eng.close()
        assert took < 14.0, f"{took:.1f}s: the items paid the timeout one by one"
        statuses = [o.status for o in outs]
        assert statuses.count("ok") <= 3 and statuses.count("missed") == 0, statuses
        skipped = [o for o in outs if o.stage == "not_attempted"]
        assert len(skipped) >= 12 - 3 - 4, [(o.status, o.stage, o.reason[:60]) for o in outs]
        assert all(o.status == "failed" and "not attempted" in o.reason for o in skipped)
        assert not [t for t in threading.enumerate() if t.name.startswith("lmcache-kv-batch")]
        ctx.close()
    finally:
        srv.stop()
    assert not os.path.exists(f"/dev/shm/{srv.pool_segment}")
