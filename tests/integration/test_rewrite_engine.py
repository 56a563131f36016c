"""The rewrite engine against the real server with the edit users write: bit-exact results,
pooled edit outputs, the edit thread's policy, the engine hooks, and clean interruption."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, rand_tokens

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import batch
from lmcache_kv_fast.batch import RewriteEngine, run_rewrite
from lmcache_kv_fast.batch._policy import ENV_POOL_OUTPUTS
from lmcache_kv_fast.copy.select import backend

C = 256
native = pytest.mark.skipif(backend().NAME != "native", reason="pooled outputs need the native core")


def drop_every_10th(kv, tokens):
    """The plain form (README / issue): a fresh output tensor every call."""
    keep = [i for i in range(len(tokens)) if i % 10 != 9]
    return kv.index_select(2, torch.tensor(keep)), [tokens[i] for i in keep]


@pytest.fixture
def wide(server):
    """4 layers x D=1024 bf16: 4 MiB per chunk, so a 2-chunk edit output is pool-sized."""
    m = make_model(server, num_layers=4, num_kv_heads=8, head_size=128)
    ctx = lmc_sdk.connect(server.url, server.http_url, m.name)
    ctx.clear(force=True)  # the session's servers are small (0.5 GiB pickle L1): room first
    yield m, ctx
    ctx.close()


def _seed(m, ctx, n, seed, tokens=2 * C):
    toks = [rand_tokens(tokens, seed=seed + i) for i in range(n)]
    for i, t in enumerate(toks):
        assert ctx.store(m.kv(tokens, seed=seed + 50 + i), t)
    return toks


def _check_all(m, ctx, toks, seed, tokens=2 * C):
    for i, t in enumerate(toks):
        want_kv, want_toks = drop_every_10th(m.kv(tokens, seed=seed + 50 + i), t)
        n = len(want_toks) // C * C
        got = ctx.retrieve(want_toks)
        assert got is not None and torch.equal(got.view(torch.int16),
                                               want_kv[:, :, :n].view(torch.int16)), i


@pytest.mark.parametrize("pool_outputs", [None, False])
def test_plain_fn_bit_exact_and_outputs_pooled(wide, pool_outputs, monkeypatch):
    monkeypatch.delenv(ENV_POOL_OUTPUTS, raising=False)
    m, ctx = wide
    toks = _seed(m, ctx, 7, 100)
    rep = batch.rewrite(ctx, toks, drop_every_10th, progress=False, pool_outputs=pool_outputs)
    assert rep.ok == 7 and rep.failed == 0, rep.summary()
    _check_all(m, ctx, toks, 100)
    if pool_outputs is None and backend().NAME == "native":
        assert rep.pooled_outputs >= 7  # every edit's output came from the warm pool
    else:
        assert rep.pooled_outputs == 0


def test_env_turns_pooled_outputs_off(wide, monkeypatch):
    monkeypatch.setenv(ENV_POOL_OUTPUTS, "0")
    m, ctx = wide
    toks = _seed(m, ctx, 3, 200)
    rep = batch.rewrite(ctx, toks, drop_every_10th, progress=False)
    assert rep.ok == 3 and rep.pooled_outputs == 0, rep.errors
    _check_all(m, ctx, toks, 200)


@native
@pytest.mark.parametrize("workers", [1, 3])
def test_outputs_kept_by_fn_stay_valid(wide, workers):
    """An fn that keeps its result and a copy: those are never recycled under it."""
    m, ctx = wide
    toks = _seed(m, ctx, 6, 300)
    kept = {}
    index = {tuple(t): i for i, t in enumerate(toks)}

    def fn(kv, t):  # edits run in retrieve-completion order: find the item by its tokens
        out, nt = drop_every_10th(kv, t)
        kept[index[tuple(t)]] = (out, out.clone())
        return out, nt

    rep = batch.rewrite(ctx, toks, fn, progress=False, workers=workers, max_in_flight=3)
    assert rep.ok == 6 and rep.pooled_outputs >= 12, rep.summary()
    assert len({o.data_ptr() for o, _ in kept.values()} |
               {c.data_ptr() for _, c in kept.values()}) == 12
    for i, (out, copy) in kept.items():
        want, _ = drop_every_10th(m.kv(2 * C, seed=350 + i), toks[i])
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        assert torch.equal(copy.view(torch.int16), want.view(torch.int16))


def test_edit_thread_gets_caller_grad_mode_and_its_own_thread_count(wide):
    m, ctx = wide
    toks = _seed(m, ctx, 4, 400)
    seen = []
    caller_threads = torch.get_num_threads()

    def fn(kv, t):
        seen.append((threading.get_ident(), torch.is_grad_enabled(), torch.get_num_threads()))
        return drop_every_10th(kv, t)

    with torch.no_grad():
        rep = batch.rewrite(ctx, toks, fn, progress=False, edit_threads=1)
    assert rep.ok == 4, rep.errors
    assert len({s[0] for s in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert all(not grad for _, grad, _ in seen)
    assert all(n == 1 for _, _, n in seen)
    assert torch.get_num_threads() == caller_threads  # the caller's thread is untouched
    _check_all(m, ctx, toks, 400)


def test_run_rewrite_with_custom_fetch_reports_in_order(wide):
    """The engine's hooks (the batched stream's modify phase uses them): items of any
    shape, a custom fetch, per-item results in input order with the new tokens."""
    m, ctx = wide
    toks = _seed(m, ctx, 5, 500)
    items = [{"id": f"s{i}", "tokens": t} for i, t in enumerate(toks)]
    items.insert(2, {"id": "missing", "tokens": rand_tokens(2 * C, seed=999)})
    got = []

    def fetch(c, item):
        return c.retrieve(item["tokens"]), item["tokens"]

    rep = run_rewrite(ctx, items, drop_every_10th, fetch=fetch, on_result=got.append,
                      max_in_flight=2)
    assert [r.index for r in got] == list(range(6))
    assert [r.status for r in got] == ["ok", "ok", "missed", "ok", "ok", "ok"], rep.errors
    assert rep.ok == 5 and rep.missed == 1 and rep.peak_in_flight <= 2
    for r in got:
        if r.status == "ok":
            assert r.value == [t for j, t in enumerate(items[r.index]["tokens"]) if j % 10 != 9]
    _check_all(m, ctx, toks, 500)


def _leftovers(srv):
    st = srv.settled_status()
    l1 = st["storage_manager"]["l1_manager"]
    return (st["active_sessions"], st["active_prefetch_jobs"], l1["read_locked_count"],
            l1["write_locked_count"])


def test_interrupt_in_the_caller_leaves_nothing(server):
    m = make_model(server, num_layers=4, num_kv_heads=8, head_size=128)
    with lmc_sdk.connect(server.url, server.http_url, m.name) as ctx:
        ctx.clear(force=True)
        toks = _seed(m, ctx, 12, 600)
        done = []

        def on_result(r):
            done.append(r.index)
            if len(done) == 3:
                raise KeyboardInterrupt

        eng = RewriteEngine(ctx, drop_every_10th, max_in_flight=3)
        with pytest.raises(KeyboardInterrupt):
            eng.run(toks, on_result)
        assert done == [0, 1, 2]
        assert _leftovers(server) == (0, 0, 0, 0)
        assert not [t for t in threading.enumerate() if t.name.startswith("lmcache-kv-batch")]
        # the context still works after an interrupted batch
        assert batch.rewrite(ctx, toks[3:5], drop_every_10th, progress=False).ok == 2


def test_engine_argument_errors(wide):
    _, ctx = wide
    for bad in (0, -1, 1.5):
        with pytest.raises(lmc_sdk.KVCacheSDKError, match="edit_threads"):
            batch.rewrite(ctx, [], drop_every_10th, edit_threads=bad, progress=False)
    with pytest.raises(lmc_sdk.KVCacheSDKError, match="pool_outputs"):
        batch.rewrite(ctx, [], drop_every_10th, pool_outputs="yes", progress=False)
    with pytest.raises(lmc_sdk.KVCacheSDKError, match="fn must be callable"):
        batch.rewrite(ctx, [], None, progress=False)
    assert batch.rewrite(ctx, [], drop_every_10th, progress=False).items == 0


def test_custom_store_replaces_store_ex_with_the_same_accounting(wide):
    """``RewriteEngine(..., store=)``: what the sdk's modify passes (a CPU engine's rows)."""
    m, ctx = wide
    toks = _seed(m, ctx, 3, 700)
    calls: list[int] = []

    def store(kv, tokens, salt):
        calls.append(len(tokens))
        return ctx.store_ex(kv, tokens, salt)

    rep = RewriteEngine(ctx, drop_every_10th, store=store).run(toks)
    assert rep.ok == 3 and len(calls) == 3, rep.summary()
    _check_all(m, ctx, toks, 700)
    with pytest.raises(ValueError, match="store must be callable"):
        RewriteEngine(ctx, drop_every_10th, store="no")
