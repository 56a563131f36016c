"""The batched stream's modify with a library edit: streams rewritten slot to slot.

Streams get their first cache from ``stream.update`` (no engine; the engine workflow with a
library edit is tests/sdk/test_sdk_engine.py). A plannable library edit on the SHM plane
takes the fused path (``sdk/_fused.py``): the stream's tokens, suffix and stored bytes are
what the same edit on tensors gives, and the report counts the fused streams. The inline
plane and plain functions keep the tensor path with the same results; a missing cache and
an edit's error are reported at the same stages as on the tensor path.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_model, rand_tokens

import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast import edits

KV = lmc_sdk.LMCacheSDKCacheKind.KV
C = 256
HEAD = 64
ROPE = edits.rope_from_config({"rope_theta": 10000.0, "head_dim": HEAD, "hidden_size": 256,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 8192})


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.fixture
def kvctx(server):
    """An sdk KV context of a fresh 2-layer, 2 x 64 bf16 model on both planes."""
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=HEAD)
    ctx = lmc_sdk.kvcache.connect(server.url, server.http_url, m.name)
    try:
        yield m, ctx
    finally:
        ctx.close()


def _streams(m, ctx, n, length, seed, salt):
    out = []
    for i in range(n):
        s = lmc_sdk.request.create_request([ctx], lambda *a: iter(()),
                                           rand_tokens(length, seed + i), cache_salt=salt)
        kv = m.kv(length, seed=seed + 50 + i)
        s.update(KV, kv, s.tokens)
        out.append((s, kv))
    return out


def _plain_drop(tensors, tokens):
    return edits.drop_every(10)(tensors[KV], tokens)


@pytest.mark.parametrize("fn", [edits.drop_every(10), edits.drop_every(10, rope=ROPE),
                                edits.streaming_llm(4, 500, rope=ROPE), _plain_drop],
                         ids=["drop", "drop-rope", "streaming", "plain"])
def test_modify_with_library_edits(kvctx, fn):
    m, ctx = kvctx
    made = _streams(m, ctx, 3, 3 * C + 40, 900, salt="fused")
    b = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2)
    for s, _ in made:
        b.add(s)
    before = [list(s.tokens) for s, _ in made]
    doc = b.modify(fn).to_dict()["metrics"]
    rep = doc["results"]
    assert doc["stages"]["lookups"] == 0  # everything was cached: no wait, on either path
    fused = fn is not _plain_drop and ctx.kv_context.transport == "shm"
    assert rep["streams_modified"] == 3 and rep["streams_failed"] == 0
    assert rep["streams_fused"] == (3 if fused else 0)
    assert [i.path for i in b.last_modify.items] == ["fused" if fused else "tensor"] * 3
    assert rep["tokens_before"] == 3 * 3 * C
    for (s, kv), old in zip(made, before, strict=True):
        want, kept = edits.drop_every(10)(kv[:, :, : 3 * C], old[: 3 * C]) \
            if fn is _plain_drop else fn(kv[:, :, : 3 * C].contiguous(), old[: 3 * C])
        assert s.tokens == kept and s.suffix_tokens == old[3 * C:]
        n = len(kept) // C * C
        got = ctx.kv_context.retrieve(kept, cache_salt="fused")
        assert got is not None and got.shape[2] == n
        assert torch.equal(bits(got), bits(want[:, :, :n]))


def test_fused_modify_waits_and_reports_a_missing_cache(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=HEAD)
    with lmc_sdk.kvcache.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        s = lmc_sdk.request.create_request([ctx], lambda *a: iter(()), rand_tokens(600, 910))
        s._stored_upto = 600  # as if an engine had been sent the prompt, and stored nothing
        b = lmc_sdk.batch.LMCacheBatchedStream()
        b.add(s)
        with pytest.raises(lmc_sdk.batch.LMCacheBatchedStreamError,
                           match="no cached kv for stream") as ei:
            b.modify(edits.drop_every(10), timeout=2.0, poll_interval=0.05)
        assert ei.value.metrics.to_dict()["metrics"]["stages"]["lookups"] >= 3
        assert b.last_modify.items[0].stage == "retrieve"
        assert len(s.tokens) == 600 and s.suffix_tokens == []


def test_fused_modify_waits_for_a_store_that_lands_late(server_shm):
    """Two of three chunks cached at first: nothing is written until the wait saw all three."""
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=HEAD)
    with lmc_sdk.kvcache.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        (s, kv), = _streams(m, ctx, 1, 2 * C, 930, salt="late")
        full = rand_tokens(C, 931)
        s.tokens.extend(full)
        kv3 = torch.cat([kv, m.kv(C, seed=932)], dim=2)
        s._stored_upto = 3 * C  # as if the engine had been sent all of it
        late = threading.Timer(0.3, ctx.kv_context.store, (kv3, list(s.tokens)),
                               {"cache_salt": "late"})
        late.start()
        try:
            b = lmc_sdk.batch.LMCacheBatchedStream()
            b.add(s)
            old = list(s.tokens)
            doc = b.modify(edits.drop_every(10), timeout=10, poll_interval=0.05).to_dict()
        finally:
            late.join()
        assert doc["metrics"]["stages"]["lookups"] >= 1
        assert b.last_modify.items[0].path == "fused"
        want, kept = edits.drop_every(10)(kv3, old)
        assert s.tokens == kept
        n = len(kept) // C * C
        got = ctx.kv_context.retrieve(kept, cache_salt="late")
        assert got is not None and got.shape[2] == n
        assert torch.equal(bits(got), bits(want[:, :, :n]))


def test_fused_modify_reports_the_edits_error(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=2, head_size=HEAD)
    with lmc_sdk.kvcache.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        (s, _kv), = _streams(m, ctx, 1, 2 * C, 920, salt="")
        old = list(s.tokens)
        b = lmc_sdk.batch.LMCacheBatchedStream()
        b.add(s)
        with pytest.raises(lmc_sdk.batch.LMCacheBatchedStreamError, match="out of range"):
            b.modify(edits.keep(range(2 * C + 10)))  # past the end of the cached prefix
        assert b.last_modify.items[0].stage == "fn"
        assert s.tokens == old
