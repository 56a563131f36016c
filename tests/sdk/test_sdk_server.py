"""lmcache_kv_fast.sdk against a real LMCache server, with upstream's lmcache.sdk as oracle.

One server with the query module (``--enable transfer_query`` on 0.5.6, the ``qstore``
server module on 0.5.7, ``query_server_kwargs``); query tensors are produced through the
server version's own server-facing classes (``QueryExporter``, in that version's venv), the
way a query-capturing engine stores them. The upstream oracle is the server version's SDK
(in-process for the main venv's 0.5.6, ``TheirContext`` in its venv otherwise). Streams
here get their first cache from ``stream.update`` (the SDK's own store), so the modify
pipeline runs without an engine; the engine workflow is tests/sdk/test_sdk_engine.py.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SERVER_VERSION, rand_tokens, start_server, unique_model_name

import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast.errors import InvalidArgumentError, LMCacheSDKError
from lmcache_kv_fast.sdk._qlayout import QueryLayoutError
from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout
from testbed.compat import TheirContext
from testbed.query_export import QueryExporter, query_server_kwargs

from .ipc_proxy import IpcForwarder

upstream = pytest.importorskip("lmcache.sdk")
KV, QUERY = lmc_sdk.LMCacheSDKCacheKind.KV, lmc_sdk.LMCacheSDKCacheKind.QUERY
CHUNK = 256
L, NH, HS, HQ = 2, 2, 64, 4


@pytest.fixture(scope="module")
def qserver() -> Iterator[LMCacheServer]:
    """A real server with the query module, SHM plane, chunk 256."""
    yield from start_server(True, chunk_size=CHUNK, l1_size_gb=0.5,
                            **query_server_kwargs(SERVER_VERSION))


@pytest.fixture(scope="module")
def exporter(qserver) -> Iterator[QueryExporter]:
    """Model 'qmodel': an NHD KV cache (2 heads of 64) and a query ring of 4 heads of 64."""
    with QueryExporter(qserver.url, "qmodel", num_layers=L, num_kv_heads=NH, head_size=HS,
                       num_q_heads=HQ, chunk_size=CHUNK, python=qserver.python) as exp:
        yield exp


def upstream_connect(server: LMCacheServer, name: str, kind: str = "kv"):
    """The server version's own SDK context (``lmcache.sdk.kvcache`` / ``.qcache``)."""
    if server.version is not None and server.python != sys.executable:
        return TheirContext(server.version, server.url, server.http_url, name, kind=kind)
    mod = upstream.qcache if kind == "query" else upstream.kvcache
    return mod.connect(server.url, server.http_url, name)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def kv_rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


# ---------------------------------------------------------------------- KV contexts
def test_connect_by_kind_and_context_members(qserver):
    name = unique_model_name("sdk")
    register_vllm_layout(qserver.url, name, num_layers=L, num_kv_heads=NH, head_size=HS,
                         block_size=128)
    for kind in (KV, "kv"):
        with lmc_sdk.connect(kind, qserver.url.removeprefix("tcp://"), qserver.http_url,
                             name, timeout=30) as ctx:
            assert ctx.kind is KV and ctx.chunk_size == CHUNK and ctx.mq_timeout == 30
            ctx.register_caches()  # 0.5.6 programs call it after building the context
            assert str(ctx.instance_id) in qserver.status()["non_cuda_context_meta"]
            assert ctx.tensor_shape(512) == (2, L, 512, NH * HS)
        assert str(ctx.instance_id) not in qserver.status()["non_cuda_context_meta"]
        ctx.close()  # idempotent
        with pytest.raises(LMCacheSDKError, match="closed"):
            ctx.register_caches()


@pytest.mark.parametrize("mla", [False, True])
def test_kv_interop_with_upstream_both_ways(qserver, mla):
    name = unique_model_name("sdk-kv")
    register_vllm_layout(qserver.url, name, num_layers=L, num_kv_heads=1 if mla else NH,
                         head_size=256 if mla else HS, block_size=128,
                         layout="MLA" if mla else "NHD")
    shape = (L, 600, 256) if mla else (2, L, 600, NH * HS)
    ours = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, name)
    theirs = upstream_connect(qserver, name)
    try:
        a, b = rand_tokens(600, 1), rand_tokens(600, 2)
        kv = kv_rand(shape, 3)
        assert ours.store(kv, a)
        got_t = theirs.retrieve(a)
        got_o = ours.retrieve(a)
        # same shape as 0.5.6 returns, for two-plane and one-plane KV ([L, T, D])
        assert got_o.shape == got_t.shape == kv[..., :512, :].shape
        assert torch.equal(bits(got_o), bits(got_t))
        assert torch.equal(bits(got_o), bits(kv[..., :512, :]))
        if not mla:  # 0.5.6 cannot store one-plane KV at all (shape checks fail)
            assert theirs.store(kv_rand(shape, 4), b)
            assert torch.equal(bits(ours.retrieve(b)), bits(kv_rand(shape, 4)[..., :512, :]))
        else:
            with pytest.raises(Exception):  # noqa: B017 - upstream's own error types
                theirs.store(kv_rand(shape, 4).unsqueeze(0), b)
    finally:
        ours.close()
        theirs.close()


def test_ipc_and_bare_host_port_urls(qserver):
    name = unique_model_name("sdk-ipc")
    register_vllm_layout(qserver.url, name, num_layers=L, num_kv_heads=NH, head_size=HS,
                         block_size=128)
    toks, kv = rand_tokens(512, 5), kv_rand((2, L, 512, NH * HS), 5)
    with IpcForwarder(qserver.url) as fwd:
        with lmc_sdk.connect(KV, fwd.url, qserver.http_url, name, timeout=30) as ctx:
            assert ctx.store(kv, toks)
            assert torch.equal(bits(ctx.retrieve(toks)), bits(kv))
        assert fwd.forwarded > 5  # the calls really went through the ipc:// endpoint
    with lmc_sdk.connect(KV, qserver.url.removeprefix("tcp://"), qserver.http_url,
                         name) as ctx:
        assert torch.equal(bits(ctx.retrieve(toks)), bits(kv))
    with pytest.raises(LMCacheSDKError, match="serves transport 'zmq'.*grpc URL"):
        lmc_sdk.connect(KV, "grpc://127.0.0.1:1", qserver.http_url, name)


# ---------------------------------------------------------------------- query tensors
def _visible(ctx, tokens, n, cache_salt="", timeout=10.0):
    """Wait until ``n`` tokens of ``tokens`` are cached: the server answers a store from
    its own server-facing classes (the exporter's, like an engine's) before the object is
    visible, so a read right after it can miss (seen on a loaded 2-core box)."""
    deadline = time.monotonic() + timeout
    while ctx.lookup(tokens, cache_salt) < n:
        assert time.monotonic() < deadline, f"{n} tokens not visible after {timeout} s"
        time.sleep(0.01)


def test_query_read_geometry_from_query_registration(qserver, exporter):
    toks = rand_tokens(600, 10)
    q = exporter.random_query(512, 10)
    assert exporter.store_query(toks, q)
    ours = lmc_sdk.connect(QUERY, qserver.url, qserver.http_url, "qmodel")
    theirs = upstream_connect(qserver, "qmodel", kind="query")
    try:
        _visible(ours, toks, 512)
        assert ours.kind is QUERY and ours.server_model_name == "qmodel##query"
        # the query ring's geometry (4 heads of 64), not the KV registration's (heads of 64)
        assert ours.layout.planes == 1 and ours.layout.hidden_size == HQ * HS
        got = ours.retrieve(toks)
        assert got.shape == (1, L, 512, HQ * HS) == ours.tensor_shape(512)
        assert torch.equal(bits(got[0]), bits(q))
        up = theirs.retrieve(toks)
        assert up.shape == got.shape and torch.equal(bits(up), bits(got))
        # ours stores (both shapes), upstream reads it bit-exact
        t2, q2 = rand_tokens(512, 11), exporter.random_query(512, 11)
        assert ours.store(q2.unsqueeze(0), t2)
        assert torch.equal(bits(theirs.retrieve(t2).reshape(q2.shape)), bits(q2))
        t3, q3 = rand_tokens(512, 12), exporter.random_query(512, 12)
        assert ours.store(q3, t3)
        assert torch.equal(bits(ours.retrieve(t3)[0]), bits(q3))
        # upstream 0.5.6 registered the KV head width (64) for queries: it cannot store them
        t4 = rand_tokens(512, 13)
        with pytest.raises(RuntimeError):
            theirs.store(exporter.random_query(512, 13).unsqueeze(0), t4)
        assert ours.retrieve(t4) is None
        with pytest.raises(InvalidArgumentError):
            ours.store(torch.zeros(1, L, 512, HS, dtype=torch.bfloat16), t4)
        # salts isolate queries like KV
        ts = rand_tokens(512, 14)
        assert exporter.store_query(ts, exporter.random_query(512, 14), cache_salt="tenant")
        _visible(ours, ts, 512, cache_salt="tenant")
        assert ours.retrieve(ts) is None and ours.retrieve(ts, cache_salt="tenant") is not None
    finally:
        ours.close()
        theirs.close()
    # the exporter's registration is untouched by the SDK contexts coming and going
    assert exporter.store_query(rand_tokens(512, 15), exporter.random_query(512, 15))


def test_query_errors_name_what_is_missing(qserver, server_shm, exporter):
    with pytest.raises(QueryLayoutError, match="--enable transfer_query.*plugin_modules.qstore"):
        lmc_sdk.qcache.connect(server_shm.url, server_shm.http_url, "qmodel")
    with pytest.raises(QueryLayoutError, match=r"query registrations: \['qmodel##query'\]"):
        lmc_sdk.qcache.connect(qserver.url, qserver.http_url, "other-model")


# ---------------------------------------------------------------------- modify without engine
def drop_every_10th(tensors, tokens):
    kv = tensors[KV]
    keep = [i for i in range(kv.shape[-2]) if i % 10 != 9]
    idx = torch.tensor(keep)
    return kv.index_select(kv.dim() - 2, idx), [tokens[i] for i in keep]


def _streams(ctxs, n, length, seed, salt=""):
    out = []
    for i in range(n):
        s = lmc_sdk.request.create_request(ctxs, lambda *a: iter(()), rand_tokens(length, seed + i),
                                           cache_salt=salt)
        kv = kv_rand((2, L, length, NH * HS), seed + i)
        s.update(KV, kv, s.tokens)
        out.append((s, kv))
    return out


def test_batch_modify_bounded_every_error_reported(qserver, exporter):
    ctx = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, "qmodel")
    try:
        made = _streams([ctx], 7, 3 * CHUNK + 40, 100, salt="mod")
        b = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2)
        for s, _ in made:
            b.add(s)
        alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        peak = [0]
        lock = threading.Lock()
        bad = {made[2][0].tokens[0], made[5][0].tokens[0]}

        def fn(tensors, tokens):
            with lock:
                alive.add(tensors[KV])
                peak[0] = max(peak[0], len(alive))
            if tokens[0] in bad:
                raise ValueError("this edit does not apply")
            return drop_every_10th(tensors, tokens)

        before = {s.request_stream_id: (list(s.tokens), list(s.suffix_tokens)) for s, _ in made}
        with pytest.raises(lmc_sdk.batch.LMCacheBatchedStreamError) as ei:
            b.modify(fn)
        err = ei.value
        assert set(err.errors) == {made[2][0].request_stream_id, made[5][0].request_stream_id}
        assert all("this edit does not apply" in r for r in err.errors.values())
        rep = err.metrics.to_dict()
        assert rep["title"] == "Batched Stream Modify Metrics"
        assert rep["metrics"]["results"]["streams_modified"] == 5
        assert rep["metrics"]["results"]["streams_failed"] == 2
        assert rep["metrics"]["results"]["peak_in_flight"] <= 2
        assert peak[0] <= 3
        for i, (s, kv) in enumerate(made):
            if i in (2, 5):  # failed: unchanged
                assert (s.tokens, s.suffix_tokens) == before[s.request_stream_id]
                continue
            old = before[s.request_stream_id][0]
            assert s.suffix_tokens == old[3 * CHUNK:]
            keep = [j for j in range(3 * CHUNK) if j % 10 != 9]
            assert s.tokens == [old[j] for j in keep]
            got = ctx.retrieve(s.tokens, cache_salt="mod")
            assert got.shape[-2] == len(keep) // CHUNK * CHUNK
            assert torch.equal(bits(got), bits(kv[:, :, keep][:, :, : got.shape[-2]]))
    finally:
        ctx.close()


def test_prefill_prepares_the_modify_buffers(qserver, exporter, monkeypatch):
    """prefill() maps and faults the buffers the next modify reads and edits into (the
    largest stream's KV, streams in flight + 1), joined before it returns; the modify
    then takes them from the pool (no new mapping) and stores the right bytes. Streams
    under MIN_PREPARE_BYTES (16 MiB; lowered here to keep the test small) get none."""
    from lmcache_kv_fast import _native
    from lmcache_kv_fast.sdk import _prepare as prepare
    from lmcache_kv_fast.sdk._prepare import modify_buffers

    ctx = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, "qmodel")
    try:
        made = _streams([ctx], 3, 9 * CHUNK + 17, 400, salt="prep")  # 2.25 MiB of KV each
        off = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2, prepare_modify=False)
        b = lmc_sdk.batch.LMCacheBatchedStream(max_in_flight=2)
        for s, _ in made:
            b.add(s)
            off.add(s)
        assert modify_buffers([s for s, _ in made], 2) == (2 * L * 9 * CHUNK * NH * HS * 2, 3)
        _native.result_pool_trim()
        r0 = _native.result_pool_stats()
        off.prefill({})
        assert _native.result_pool_stats()["reserved"] == r0["reserved"]
        for s, _ in made:
            s.done = False  # the hook yields no token: 0.5.6 calls such a stream done
        b.prefill({})  # 2.25 MiB per stream: under the real threshold
        assert _native.result_pool_stats()["reserved"] == r0["reserved"]
        for s, _ in made:
            s.done = False
        monkeypatch.setattr(prepare, "MIN_PREPARE_BYTES", 2 << 20)
        b.prefill({})
        r1 = _native.result_pool_stats()
        assert r1["reserved"] - r0["reserved"] == 3 and r1["entries"] == 3
        assert not [t for t in threading.enumerate() if "prepare-modify" in t.name]
        b.modify(drop_every_10th)
        r2 = _native.result_pool_stats()
        assert r2["misses"] == r1["misses"]
        assert r2["hits"] - r1["hits"] == 6  # 3 reads + 3 edits
        for s, kv in made:
            keep = [j for j in range(9 * CHUNK) if j % 10 != 9]
            got = ctx.retrieve(s.tokens, cache_salt="prep")
            assert got.shape[-2] == len(keep) // CHUNK * CHUNK
            assert torch.equal(bits(got), bits(kv[:, :, keep][:, :, : got.shape[-2]]))
    finally:
        ctx.close()
        _native.result_pool_trim()


def test_modify_does_not_grow_mallocs_heap(qserver, exporter):
    """A fresh process's modify of 16 streams of 2 MiB, each edit 1.8 MiB: the reads and
    the edit's outputs come from the result pool, so glibc's heap does not grow. (From
    torch's allocator the edits grew it by ~15 MiB: once a freed mapping raised glibc's
    mmap threshold, outputs of a few MiB came from the heap, which its alignment holes
    kept growing.) The stored edits are checked byte for byte."""
    import json
    import subprocess
    import sys

    ctx = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, "qmodel")
    try:
        n = 8 * CHUNK
        made = _streams([ctx], 16, n, 700, salt="heap")  # [2, 2, 2048, 128] bf16: 2 MiB
        cfg = {"url": qserver.url, "http_url": qserver.http_url, "model": "qmodel",
               "salt": "heap", "prompts": [list(s.tokens) for s, _ in made]}
        child = Path(__file__).parent / "programs" / "modify_heap_child.py"
        out = subprocess.run([sys.executable, str(child)], input=json.dumps(cfg),
                             capture_output=True, text=True, timeout=300)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("HEAP ")]
        assert out.returncode == 0 and lines, out.stderr[-3000:]
        res = json.loads(lines[0][5:])
        assert res["modified"] == 16
        grown = res["after"]["arena"] - res["before"]["arena"]
        assert grown < 4 << 20, res  # small objects only (tokens, requests)
        assert res["after"]["mapped"] - res["before"]["mapped"] < 4 << 20, res
        assert res["pool_hits"] + res["pool_misses"] >= 32, res  # 16 reads + 16 edits
        keep = [j for j in range(n) if j % 10 != 9]
        for s, kv in made:
            got = ctx.retrieve([s.tokens[j] for j in keep], cache_salt="heap")
            assert got is not None and got.shape[-2] == len(keep) // CHUNK * CHUNK
            assert torch.equal(bits(got), bits(kv[:, :, keep][:, :, : got.shape[-2]]))
    finally:
        ctx.close()


def test_modify_gets_query_tensors_too(qserver, exporter):
    kctx = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, "qmodel")
    qctx = lmc_sdk.qcache.connect(qserver.url, qserver.http_url, "qmodel")
    try:
        (s, kv), = _streams([kctx, qctx], 1, 2 * CHUNK, 300)
        q = exporter.random_query(2 * CHUNK, 300)
        assert exporter.store_query(s.tokens, q)
        seen = {}

        def fn(tensors, tokens):
            seen.update(tensors)
            return tensors[KV], tokens

        b = lmc_sdk.batch.LMCacheBatchedStream()
        b.add(s)
        b.modify(fn)
        assert set(seen) == {KV, QUERY}
        assert torch.equal(bits(seen[QUERY][0]), bits(q))
        assert torch.equal(bits(seen[KV]), bits(kv))
    finally:
        kctx.close()
        qctx.close()


def test_modify_waits_then_reports_a_missing_cache(qserver, exporter):
    ctx = lmc_sdk.kvcache.connect(qserver.url, qserver.http_url, "qmodel")
    try:
        s = lmc_sdk.request.create_request([ctx], lambda *a: iter(()), rand_tokens(600, 400))
        b = lmc_sdk.batch.LMCacheBatchedStream()
        b.add(s)
        with pytest.raises(lmc_sdk.batch.LMCacheBatchedStreamError, match="run prefill"):
            b.modify(drop_every_10th, timeout=0.2)
        s._stored_upto = 600  # as if an engine had been sent the prompt, and stored nothing
        # The timeout bounds the first read too (0.3 s of it went there under CI load),
        # so it is long enough for the back-off to send several lookups.
        with pytest.raises(lmc_sdk.batch.LMCacheBatchedStreamError,
                           match="no cached kv for stream") as ei:
            b.modify(drop_every_10th, timeout=2.0, poll_interval=0.05)
        assert ei.value.metrics.to_dict()["metrics"]["stages"]["lookups"] >= 3
        assert len(s.tokens) == 600 and s.suffix_tokens == []
    finally:
        ctx.close()
