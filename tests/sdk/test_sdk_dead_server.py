"""The batched stream's modify against a server SIGKILLed mid-modify (issue 19, item 10).

The modify runs on the rewrite engine: after one stream's failure it pings the server
once and, with no answer, stops at once (not the timeout per stream) with
``LMCacheBatchedStreamServerError`` — both the batched stream's error (every stream not
modified listed, the phase's report) and ``ServerUnavailableError`` — and every stream
says what happened to it (``batch.last_modify``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import rand_tokens, unique_model_name

import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast.errors import ServerUnavailableError
from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout

KV = lmc_sdk.LMCacheSDKCacheKind.KV
CHUNK = 256
L, NH, HS = 2, 2, 64
N = 10
TIMEOUT = 2.0
KILL_AT = 3  # the edit of this stream kills the server


@pytest.fixture
def dying_server() -> Iterator[LMCacheServer]:
    srv = LMCacheServer(shm=True, chunk_size=CHUNK, l1_size_gb=0.25)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
    assert not os.path.exists(f"/dev/shm/{srv.pool_segment}"), "server segment left"


def test_modify_on_a_killed_server_stops_at_once_and_reports_every_stream(
        dying_server: LMCacheServer) -> None:
    srv = dying_server
    name = unique_model_name("dead")
    register_vllm_layout(srv.url, name, num_layers=L, num_kv_heads=NH, head_size=HS,
                         block_size=128)
    ctx = lmc_sdk.kvcache.connect(srv.url, srv.http_url, name, timeout=TIMEOUT)
    try:
        b = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2, progress=False)
        streams = []
        for i in range(N):
            s = lmc_sdk.request.create_request([ctx], lambda *a: iter(()),
                                               rand_tokens(2 * CHUNK, 500 + i))
            s.update(KV, torch.randn(2, L, 2 * CHUNK, NH * HS).to(torch.bfloat16), s.tokens)
            b.add(s)
            streams.append(s)
        before = {s.request_stream_id: list(s.tokens) for s in streams}
        calls = [0]

        def fn(tensors, tokens):
            calls[0] += 1
            if calls[0] == KILL_AT:
                srv.kill()
            kv = tensors[KV]
            return kv[:, :, :CHUNK], tokens[:CHUNK]

        t0 = time.monotonic()
        with pytest.raises(lmc_sdk.batch.LMCacheBatchedStreamServerError,
                           match="unavailable") as ei:
            b.modify(fn)
        took = time.monotonic() - t0
        assert took < 4 * TIMEOUT + 4.0, f"{took:.1f}s: the modify paid the timeout per stream"
        err = ei.value
        assert isinstance(err, ServerUnavailableError)
        assert isinstance(err, lmc_sdk.batch.LMCacheBatchedStreamError)
        out = b.last_modify
        assert out is not None and out.server_error is not None
        stages = {m.stream.request_stream_id: m.stage for m in out.items if m.error}
        assert set(err.errors) == set(stages)
        done = [m for m in out.items if m.error is None]
        assert len(done) >= KILL_AT - 2  # streams well before the kill were stored
        assert 1 <= sum(st != "not_attempted" for st in stages.values()) <= 3  # in flight
        assert sum(st == "not_attempted" for st in stages.values()) >= N - KILL_AT - 2
        assert all(r.startswith(f"{stages[sid]}: ") for sid, r in err.errors.items())
        res = err.metrics.to_dict()["metrics"]["results"]
        assert res["streams_modified"] == len(done) and res["streams_failed"] == len(stages)
        for m in out.items:  # modified streams were updated, the others left as they were
            sid = m.stream.request_stream_id
            want = before[sid][:CHUNK] if m.error is None else before[sid]
            assert m.stream.tokens == want
        assert not [t.name for t in threading.enumerate()
                    if t.name.startswith("lmcache-kv-batch")]
    finally:
        t0 = time.monotonic()
        ctx.close()
        assert time.monotonic() - t0 < TIMEOUT + 6.0
