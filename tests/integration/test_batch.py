"""Batch API against the real server: equal to the sequential path, errors per item,
bounded memory, clean cancellation."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import make_model, new_server, rand_tokens

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import batch

C = 256


def drop_every_10th(kv, toks):
    keep = [i for i in range(len(toks)) if (i + 1) % 10]
    idx = torch.tensor(keep)
    return kv.index_select(-2, idx).contiguous(), [toks[i] for i in keep]


@pytest.fixture
def small(server):
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)  # 512 KiB / chunk
    ctx = lmc_sdk.connect(server.url, server.http_url, m.name)
    yield m, ctx
    ctx.close()


def test_store_many_and_retrieve_many_equal_sequential(small):
    m, ctx = small
    seqs = [(m.kv(C * (1 + i % 3), seed=i), rand_tokens(C * (1 + i % 3), seed=100 + i))
            for i in range(10)]
    rep = batch.store_many(ctx, seqs)
    assert rep.ok == 10 and rep.failed == 0 and rep.items == 10
    assert rep.tokens_moved == sum(kv.shape[2] for kv, _ in seqs)
    got = list(batch.retrieve_many(ctx, [t for _, t in seqs] + [rand_tokens(C, seed=999)]))
    assert [i for i, _ in got] == list(range(11))
    for (_i, kv), (kv_ref, toks) in zip(got, seqs, strict=False):
        assert torch.equal(kv, kv_ref)
        assert torch.equal(kv, ctx.retrieve(toks))
    assert got[10][1] is None


def test_retrieve_many_with_out_pool(small):
    m, ctx = small
    seqs = [(m.kv(2 * C, seed=i), rand_tokens(2 * C, seed=200 + i)) for i in range(6)]
    assert batch.store_many(ctx, seqs).ok == 6
    pool = batch.BufferPool(ctx, 2 * C, 3)
    report = batch.BatchReport()
    for i, kv in batch.retrieve_many(ctx, [t for _, t in seqs], out_pool=pool, report=report):
        assert torch.equal(kv, seqs[i][0])
    assert report.ok == 6 and report.peak_in_flight <= 2


def test_retrieve_many_progress(small, monkeypatch):
    """progress=True drives one progress bar over the items (total known for a list)."""
    m, ctx = small
    seqs = [(m.kv(C, seed=i), rand_tokens(C, seed=500 + i)) for i in range(4)]
    assert batch.store_many(ctx, seqs).ok == 4
    bars = []

    from lmcache_kv_fast.batch import _api
    from lmcache_kv_fast.progress import Progress

    class Recording(Progress):
        def __init__(self, total, desc, enabled, unit="seq"):
            super().__init__(total, desc, False)
            self.args, self.updates, self.closed = (total, desc, enabled), 0, False
            bars.append(self)

        def update(self, k=1):
            self.updates += k

        def close(self):
            self.closed = True

    monkeypatch.setattr(_api, "Progress", Recording)
    got = list(batch.retrieve_many(ctx, [t for _, t in seqs], progress=True))
    assert all(torch.equal(kv, seqs[i][0]) for i, kv in got)
    assert len(bars) == 1 and bars[0].args == (4, "retrieve_many", True)
    assert bars[0].updates == 4 and bars[0].closed
    list(batch.retrieve_many(ctx, iter([seqs[0][1]])))  # default: off; length unknown
    assert bars[1].args == (None, "retrieve_many", False)


def test_rewrite_equals_sequential(small):
    m, ctx = small
    toks = [rand_tokens(3 * C, seed=300 + i) for i in range(8)]
    for i, t in enumerate(toks):
        assert ctx.store(m.kv(3 * C, seed=400 + i), t)
    rep = batch.rewrite(ctx, toks, drop_every_10th, progress=False)
    assert rep.ok == 8 and rep.failed == 0 and rep.missed == 0
    assert {"retrieve", "fn", "store"} <= set(rep.stage_seconds)
    for i, t in enumerate(toks):
        want_kv, want_toks = drop_every_10th(m.kv(3 * C, seed=400 + i), t)
        n = len(want_toks) // C * C
        assert torch.equal(ctx.retrieve(want_toks), want_kv[:, :, :n])


@pytest.mark.parametrize("workers", [None, 1, 2, 3])
def test_rewrite_with_alloc_equals_sequential_and_reuses_buffers(small, workers):
    """fn(kv, tokens, *, alloc): the edit lands in pooled buffers that come back after each
    store, so a long batch reuses a handful of buffers; results equal the sequential edit."""
    m, ctx = small
    toks = [rand_tokens(3 * C, seed=700 + i) for i in range(12)]
    for i, t in enumerate(toks):
        assert ctx.store(m.kv(3 * C, seed=800 + i), t)
    seen: set[int] = set()

    def fn(kv, t, *, alloc):
        keep = [i for i in range(len(t)) if (i + 1) % 10]
        out = alloc((*kv.shape[:-2], len(keep), kv.shape[-1]), kv.dtype)
        assert out.is_contiguous() and out.dtype == kv.dtype
        seen.add(out.data_ptr())
        torch.index_select(kv, -2, torch.tensor(keep), out=out)
        return out, [t[i] for i in keep]

    rep = batch.rewrite(ctx, toks, fn, workers=workers, max_in_flight=3, progress=False)
    assert rep.ok == 12 and rep.failed == 0, rep.summary()
    assert 1 <= len(seen) <= 4  # <= max_in_flight + 1 buffers for 12 edits
    for i, t in enumerate(toks):
        want_kv, want_toks = drop_every_10th(m.kv(3 * C, seed=800 + i), t)
        n = len(want_toks) // C * C
        assert torch.equal(ctx.retrieve(want_toks), want_kv[:, :, :n])


def test_rewrite_in_place_edit_returning_a_view_of_kv(small):
    """fn may edit the retrieved buffer in place and return a (non-contiguous) view of it."""
    m, ctx = small
    toks = [rand_tokens(2 * C, seed=900 + i) for i in range(5)]
    for i, t in enumerate(toks):
        assert ctx.store(m.kv(2 * C, seed=950 + i), t)

    def second_chunk_halved(kv, t):
        kv[:, :, C:].mul_(0.5)
        return kv[:, :, C:], t[C:]

    rep = batch.rewrite(ctx, toks, second_chunk_halved, progress=False)
    assert rep.ok == 5, rep.summary()
    for i, t in enumerate(toks):
        orig = m.kv(2 * C, seed=950 + i)
        assert torch.equal(ctx.retrieve(t[C:]), orig[:, :, C:] * 0.5)
        assert torch.equal(ctx.retrieve(t), orig)  # the cached original is untouched


def test_rewrite_alloc_and_workers_errors(small):
    m, ctx = small
    toks = [rand_tokens(C, seed=990 + i) for i in range(3)]
    for i, t in enumerate(toks):
        assert ctx.store(m.kv(C, seed=995 + i), t)

    def bad_alloc(kv, t, *, alloc):
        return alloc((2, -1, 3), kv.dtype), t

    rep = batch.rewrite(ctx, toks, bad_alloc, progress=False)
    assert rep.failed == 3 and all(e.stage == "fn" and "negative dimension" in e.reason
                                   for e in rep.errors)
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(lmc_sdk.KVCacheSDKError, match="workers must be a positive int"):
            batch.rewrite(ctx, toks, drop_every_10th, workers=bad, progress=False)


def test_rewrite_records_misses_failures_and_goes_on(small):
    m, ctx = small
    toks = [rand_tokens(2 * C, seed=500 + i) for i in range(6)]
    for i in (0, 2, 3, 5):
        assert ctx.store(m.kv(2 * C, seed=600 + i), toks[i])

    def fn(kv, t):
        if t == toks[3][: len(t)]:
            raise RuntimeError("boom")
        return drop_every_10th(kv, t)

    rep = batch.rewrite(ctx, toks, fn, progress=False)
    assert rep.items == 6 and rep.ok == 3 and rep.missed == 2 and rep.failed == 1
    by_index = {e.index: e for e in rep.errors}
    assert by_index[1].stage == "retrieve" and by_index[4].stage == "retrieve"
    assert by_index[3].stage == "fn" and "boom" in by_index[3].reason


def test_batch_with_overfull_l1_reports_refusals():
    with new_server(shm=True, l1_size_gb=0.0625) as srv:  # 64 MiB
        m = make_model(srv, num_layers=4, num_kv_heads=8, head_size=128)  # 4 MiB / chunk
        with lmc_sdk.connect(srv.url, srv.http_url, m.name) as ctx:
            items = [(m.kv(4 * C, seed=i), rand_tokens(4 * C, seed=700 + i)) for i in range(8)]
            rep = batch.store_many(ctx, items, max_in_flight=2)  # 128 MiB into 64 MiB
            assert rep.items == 8 and rep.failed >= 1 and rep.ok >= 1
            assert all("refused" in e.reason for e in rep.errors)
            for i, (kv, toks) in enumerate(items):
                if i not in {e.index for e in rep.errors}:
                    got = ctx.retrieve(toks)
                    assert got is None or torch.equal(got, kv[:, :, : got.shape[2]])


def test_memory_bound_200_sequences(small):
    m, ctx = small
    seqs = [(m.kv(C, seed=i), rand_tokens(C, seed=800 + i)) for i in range(200)]
    gen_items = ((kv, t) for kv, t in seqs)
    rep = batch.store_many(ctx, gen_items, max_in_flight=3)
    assert rep.ok == 200 and rep.peak_in_flight <= 3
    alive = {"now": 0, "max": 0}
    lock = threading.Lock()

    def fn(kv, t):
        with lock:
            alive["now"] += 1
            alive["max"] = max(alive["max"], alive["now"])
        try:
            return drop_every_10th(kv, t)
        finally:
            with lock:
                alive["now"] -= 1

    rep2 = batch.rewrite(ctx, [t for _, t in seqs], fn, max_in_flight=3, progress=False)
    assert rep2.ok == 0 and rep2.failed == 200  # 230 tokens < one chunk: nothing whole to store
    assert rep2.peak_in_flight <= 3 and alive["max"] <= 3


def _leftovers(srv):
    st = srv.settled_status()
    l1 = st["storage_manager"]["l1_manager"]
    return (st["active_sessions"], st["active_prefetch_jobs"], l1["read_locked_count"],
            l1["write_locked_count"])


def test_cancellation_by_interrupt_leaves_nothing(small, server):
    m, ctx = small
    toks = [rand_tokens(2 * C, seed=900 + i) for i in range(30)]
    assert batch.store_many(ctx, [(m.kv(2 * C, seed=i), t) for i, t in enumerate(toks)]).ok == 30
    calls = {"n": 0}

    def fn(kv, t):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return drop_every_10th(kv, t)

    with pytest.raises(KeyboardInterrupt):
        batch.rewrite(ctx, toks, fn, progress=False)
    assert _leftovers(server) == (0, 0, 0, 0)


def test_closing_context_mid_batch_leaves_nothing(server):
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)
    ctx = lmc_sdk.connect(server.url, server.http_url, m.name)
    toks = [rand_tokens(2 * C, seed=1000 + i) for i in range(40)]
    assert batch.store_many(ctx, [(m.kv(2 * C, seed=i), t) for i, t in enumerate(toks)]).ok == 40

    def slow_fn(kv, t):
        time.sleep(0.05)
        return drop_every_10th(kv, t)

    closer = threading.Timer(0.3, ctx.close)
    closer.start()
    rep = batch.rewrite(ctx, toks, slow_fn, progress=False)
    closer.join()
    # close() lets the in-flight items finish their server calls; the rest are not started
    # (cancelled) or fail with a clear "closed" error
    assert rep.items + rep.cancelled == 40 and rep.ok < 40
    assert rep.cancelled >= 1 or any("closed" in e.reason for e in rep.errors)
    assert all("closed" in e.reason for e in rep.errors)
    assert _leftovers(server) == (0, 0, 0, 0)
    regs = server.status().get("non_cuda_context_meta", {})
    assert str(ctx.instance_id) not in regs and str(ctx.writer_instance_id) not in regs
