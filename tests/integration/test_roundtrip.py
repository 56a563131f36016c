"""Store/retrieve against the real LMCache server (0.5.6, or LMCACHE_KV_FAST_TEST_SERVER),
SHM and pickle (inline) planes."""

from __future__ import annotations

import pytest
import torch
from conftest import SERVER_VERSION, Model, make_model, rand_tokens

import lmcache_kv_fast as lkf
import lmcache_kv_fast.kvcache as lmc_sdk

C = 256


@pytest.fixture
def ctx(model: Model):
    c = lmc_sdk.connect(model.server.url, model.server.http_url, model.name, timeout=20)
    yield c
    lmc_sdk.close(c)


def test_transport_matches_server(ctx, server):
    assert ctx.transport == ("shm" if server.shm else "pickle")
    assert ctx.chunk_size == C
    assert ctx.instance_id > 0 and ctx.instance_id < 2**63
    assert ctx.server_version.startswith(SERVER_VERSION)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_roundtrip_bit_exact_dtypes(server, dtype):
    m = make_model(server, dtype=dtype, num_layers=3, num_kv_heads=4, head_size=64)
    toks = rand_tokens(2 * C, seed=1)
    kv = m.kv(2 * C, seed=2)
    with lmc_sdk.connect(server.url, server.http_url, m.name, timeout=20) as ctx:
        assert lmc_sdk.store(ctx, kv, toks) is True
        got = lmc_sdk.retrieve(ctx, toks)
    assert got is not None and got.dtype == dtype and got.is_contiguous()
    assert got.shape == kv.shape
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))


def test_mla_single_plane_roundtrip(server):
    m = make_model(server, mla=True, num_layers=3, head_size=576)
    toks = rand_tokens(3 * C, seed=3)
    kv = m.kv(3 * C, seed=4)
    assert kv.shape == (3, 3 * C, 576)
    with lmc_sdk.connect(server.url, server.http_url, m.name, timeout=20) as ctx:
        assert ctx.layout.planes == 1
        assert ctx.store(kv, toks)
        got = ctx.retrieve(toks)
        assert got is not None and got.shape == (3, 3 * C, 576)
        assert torch.equal(got, kv)
        # the 4-D [1, L, T, D] form is accepted as well and means the same bytes
        toks2 = rand_tokens(C, seed=5)
        kv2 = m.kv(C, seed=6).unsqueeze(0)
        assert ctx.store(kv2, toks2)
        assert torch.equal(ctx.retrieve(toks2), kv2[0])


def test_hnd_and_flashinfer_registrations(server):
    for layout in ("HND", "FLASHINFER"):
        m = make_model(server, layout=layout, num_layers=2, num_kv_heads=4, head_size=64)
        toks = rand_tokens(C, seed=7)
        kv = m.kv(C, seed=8)
        with lmc_sdk.connect(server.url, server.http_url, m.name, timeout=20) as ctx:
            assert ctx.layout.num_kv_heads == 4 and ctx.layout.head_dim == 64
            assert ctx.store(kv, toks)
            assert torch.equal(ctx.retrieve(toks), kv)


def test_sub_chunk_and_empty_return_none(ctx, model):
    assert ctx.retrieve([]) is None
    assert ctx.retrieve(rand_tokens(C - 1)) is None
    kv = model.kv(C - 1)
    assert ctx.store(kv, rand_tokens(C - 1)) is False
    assert ctx.store_ex(kv, rand_tokens(C - 1)).chunks_total == 0


def test_unaligned_length_truncated(ctx, model):
    toks = rand_tokens(2 * C + 100, seed=9)
    kv = model.kv(2 * C + 100, seed=10)
    res = ctx.store_ex(kv, toks)
    assert res.ok and res.chunks_total == 2 and res.tokens_stored == 2 * C
    got = ctx.retrieve(toks)
    assert got.shape[2] == 2 * C
    assert torch.equal(got, kv[:, :, : 2 * C])


def test_divergent_prefix_partial_hit(ctx, model):
    toks = rand_tokens(4 * C, seed=11)
    kv = model.kv(4 * C, seed=12)
    assert ctx.store(kv, toks)
    other = list(toks)
    other[2 * C + 5] = (other[2 * C + 5] + 1) % 2**31  # diverge inside chunk 2
    got = ctx.retrieve(other)
    assert got.shape[2] == 2 * C
    assert torch.equal(got, kv[:, :, : 2 * C])
    assert ctx.lookup(other) == 2 * C
    assert ctx.lookup(toks) == 4 * C


def test_unknown_tokens_miss(ctx):
    assert ctx.retrieve(rand_tokens(3 * C, seed=13)) is None
    assert ctx.lookup(rand_tokens(3 * C, seed=13)) == 0


def test_salt_isolation(ctx, model):
    toks = rand_tokens(C, seed=14)
    kv_a, kv_b = model.kv(C, seed=15), model.kv(C, seed=16)
    assert ctx.store(kv_a, toks, cache_salt="tenant-a")
    assert ctx.retrieve(toks) is None
    assert ctx.retrieve(toks, cache_salt="tenant-b") is None
    assert ctx.store(kv_b, toks, cache_salt="tenant-b")
    assert torch.equal(ctx.retrieve(toks, cache_salt="tenant-a"), kv_a)
    assert torch.equal(ctx.retrieve(toks, cache_salt="tenant-b"), kv_b)


def test_store_same_data_twice(ctx, model):
    toks = rand_tokens(2 * C, seed=17)
    kv = model.kv(2 * C, seed=18)
    first = ctx.store_ex(kv, toks)
    assert first.ok and first.chunks_written == 2
    second = ctx.store_ex(kv, toks)
    # Upstream reports False here on SHM (indistinguishable from L1 full); we say why.
    assert second.ok and second.chunks_already_cached == 2 and second.chunks_written == 0
    assert ctx.store(kv, toks) is True
    assert torch.equal(ctx.retrieve(toks), kv)


def test_extend_existing_prefix(ctx, model):
    toks = rand_tokens(3 * C, seed=19)
    kv = model.kv(3 * C, seed=20)
    assert ctx.store(kv[:, :, :C].contiguous(), toks[:C])
    res = ctx.store_ex(kv, toks)
    assert res.ok and res.chunks_written == 2 and res.chunks_already_cached == 1
    assert torch.equal(ctx.retrieve(toks), kv)


def test_many_sequences_one_session(ctx, model):
    seqs = [(rand_tokens(C * (1 + i % 3), seed=100 + i), model.kv(C * (1 + i % 3), seed=200 + i))
            for i in range(12)]
    for toks, kv in seqs:
        assert ctx.store(kv, toks)
    for toks, kv in reversed(seqs):
        got = ctx.retrieve(toks)
        assert torch.equal(got, kv)


def test_retrieve_into_out(ctx, model):
    toks = rand_tokens(2 * C, seed=21)
    kv = model.kv(2 * C, seed=22)
    assert ctx.store(kv, toks)
    out = torch.zeros(2, model.num_layers, 3 * C, model.hidden, dtype=model.dtype)
    got = ctx.retrieve(toks, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape[2] == 2 * C
    assert torch.equal(got, kv)


def test_noncontiguous_and_strided_inputs(ctx, model):
    toks = rand_tokens(C, seed=23)
    base = model.kv(2 * C, seed=24)
    view = base[:, :, ::2]  # non-contiguous
    assert ctx.store(view, toks)
    assert torch.equal(ctx.retrieve(toks), view)


def test_use_after_close_raises(model):
    ctx = lmc_sdk.connect(model.server.url, model.server.http_url, model.name, timeout=20)
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(lkf.KVCacheSDKError, match="closed"):
        ctx.retrieve(rand_tokens(C))
    with pytest.raises(lkf.ContextClosedError):
        lmc_sdk.store(ctx, model.kv(C), rand_tokens(C))


def test_close_unregisters(model):
    ctx = lmc_sdk.connect(model.server.url, model.server.http_url, model.name, timeout=20)
    ids = {str(ctx.instance_id), str(ctx.writer_instance_id)}  # reader + writer (SHM)
    assert len(ids) == (2 if ctx.transport == "shm" else 1)
    assert ids <= set(model.server.status().get("non_cuda_context_meta", {}))
    ctx.close()
    assert not ids & set(model.server.status().get("non_cuda_context_meta", {}))


def test_no_leftover_sessions_or_locks(server):
    m = make_model(server)
    with lmc_sdk.connect(server.url, server.http_url, m.name, timeout=20) as ctx:
        toks = rand_tokens(2 * C, seed=25)
        assert ctx.store(m.kv(2 * C), toks)
        assert ctx.retrieve(toks) is not None
        assert ctx.retrieve(rand_tokens(2 * C, seed=26)) is None
        assert ctx.lookup(toks) == 2 * C
        st = server.settled_status()
        assert st["active_sessions"] == 0
        assert st["active_prefetch_jobs"] == 0
        assert st["storage_manager"]["l1_manager"]["read_locked_count"] == 0
        assert st["storage_manager"]["l1_manager"]["write_locked_count"] == 0


def test_unawaited_session_ends_are_delivered_by_close(server):
    """end_session is sent without waiting for its reply; close() collects every reply
    first, so right after close the server holds no session of ours (no polling)."""
    m = make_model(server)
    ctx = lmc_sdk.connect(server.url, server.http_url, m.name, timeout=20)
    toks = rand_tokens(2 * C, seed=27)
    try:
        assert ctx.store(m.kv(2 * C), toks)
        for i in range(40):
            assert ctx.retrieve(toks) is not None
            assert ctx.retrieve(rand_tokens(C, seed=2000 + i)) is None
            assert ctx.lookup(toks) == 2 * C
        assert ctx.ping()  # replies of fired calls never confuse a waiting call
    finally:
        ctx.close()
    st = server.status()
    assert st["active_sessions"] == 0 and st["active_prefetch_jobs"] == 0, st
    assert st["storage_manager"]["l1_manager"]["read_locked_count"] == 0


def test_clear_drops_cached_kv(ctx, model):
    toks = rand_tokens(C, seed=41)
    assert ctx.store(model.kv(C), toks)
    assert ctx.lookup(toks) == C
    ctx.clear()
    assert ctx.lookup(toks) == 0


def test_request_configs_pass_through(ctx, model):
    toks = rand_tokens(C, seed=43)
    kv = model.kv(C, seed=44)
    rc = {"lmcache.tag.user": "alice", "priority": 3}
    assert lmc_sdk.store(ctx, kv, toks, request_configs=rc)
    assert torch.equal(lmc_sdk.retrieve(ctx, toks, request_configs=rc), kv)
    assert ctx.lookup(toks, request_configs=rc) == C
    # not part of cache identity: found without it too
    assert torch.equal(ctx.retrieve(toks), kv)
    with pytest.raises(TypeError, match="request_configs"):
        ctx.retrieve(toks, request_configs={1: "x"})
    with pytest.raises(TypeError, match="request_configs"):
        ctx.store(kv, toks, request_configs=["x"])
