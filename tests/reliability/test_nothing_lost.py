"""Nothing lost under L1 pressure (64 MiB L1, 256 KiB chunks): every store that returned
True reads back bit-exact right away and later (unless evicted: then a miss or a shorter
prefix, never other bytes); a store that did not fit returns False or raises, never True.
Includes the pickle-plane defect of docs/protocol.md §10.4: the server's pickle ``commit_store`` says
True while nothing is stored (L1 full, or keys left staged by an earlier failed commit).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator

import pytest
import torch
from conftest import Model, make_model, rand_tokens
from rel_helpers import install_frame_watch, leftovers, one_frame_messages

import lmcache_kv_fast as lkf
from lmcache_kv_fast.dataplane.pickle_plane import dumps_chunks
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.protocol.types import (
    IPCCacheServerKey,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.transport.zmq_client import ZmqClient

C = 256
L, NH, HS = 2, 2, 64
D = NH * HS
CHUNK_BYTES = 2 * L * C * D * 2  # 256 KiB
L1_BYTES = 64 << 20

install_frame_watch()


def _small_server(shm: bool) -> Iterator[Model]:
    srv = LMCacheServer(shm=shm, l1_size_gb=0.0625)
    try:
        srv.start()
        yield make_model(srv, num_layers=L, num_kv_heads=NH, head_size=HS)
    finally:
        srv.stop()
    assert one_frame_messages() == []


@pytest.fixture(scope="module", params=["shm", "pickle"])
def small(request: pytest.FixtureRequest) -> Iterator[Model]:
    yield from _small_server(request.param == "shm")


@pytest.fixture
def small_pickle_own() -> Iterator[Model]:
    """A pickle server of its own: the defect test leaves keys staged on it for good."""
    yield from _small_server(False)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_every_true_store_reads_back(small: Model) -> None:
    m, srv = small, small.server
    rng = random.Random(1)
    kept: list[tuple[list[int], torch.Tensor]] = []
    outcomes = {"true": 0, "false": 0, "error": 0}
    with lkf.connect(srv.url, srv.http_url, m.name, timeout=20) as ctx:
        for i in range(160):  # ~400 chunks = ~100 MiB through a 64 MiB L1
            n = rng.randint(1, 4)
            toks, kv = rand_tokens(n * C, seed=10_000 + i), m.kv(n * C, seed=20_000 + i)
            try:
                ok = ctx.store(kv, toks)
            except lkf.KVCacheSDKError:
                outcomes["error"] += 1
                continue
            if not ok:
                outcomes["false"] += 1
                assert ctx.lookup(toks) < n * C  # False: not all of it is there
                continue
            outcomes["true"] += 1
            got = ctx.retrieve(toks)  # right after True: all of it, bit-exact
            assert got is not None and _same(got, kv), f"store {i} said True"
            kept.append((toks, kv))
        evicted = mismatches = 0
        for toks, kv in kept:  # later: bit-exact or (partly) evicted, never other bytes
            got = ctx.retrieve(toks)
            if got is None or got.shape[2] < kv.shape[2]:
                evicted += 1
            if got is not None and not _same(got, kv[:, :, :got.shape[2]]):
                mismatches += 1
    print(f"{'shm' if srv.shm else 'pickle'}: {outcomes}, evicted later {evicted}, "
          f"mismatches {mismatches}")
    assert mismatches == 0
    assert outcomes["true"] > 0
    assert not any(leftovers(srv).values())


def test_store_larger_than_l1_is_never_true(small: Model) -> None:
    m, srv = small, small.server
    n = L1_BYTES // CHUNK_BYTES + 20  # does not fit even in an empty L1
    toks, kv = rand_tokens(n * C, seed=3), m.kv(n * C, seed=3)
    with lkf.connect(srv.url, srv.http_url, m.name, timeout=30) as ctx:
        res = ctx.store_ex(kv, toks)
        assert not res.ok and res.chunks_refused > 0
        assert res.chunks_written + res.chunks_already_cached + res.chunks_refused == n
        assert ctx.store(kv, toks) is False
        assert ctx.lookup(toks) == res.tokens_stored < n * C
        got = ctx.retrieve(toks)
        if got is not None:  # only the reported prefix, and only the right bytes
            assert got.shape[2] == res.tokens_stored and _same(got, kv[:, :, :got.shape[2]])
    assert not any(leftovers(srv).values())


def _raw_register(client: ZmqClient, name: str) -> int:
    iid = secrets.randbits(62) + 1
    p = RegisterEngineDrivenContextPayload(instance_id=iid, model_name=name, world_size=1,
                                           block_size=16, num_layers=L, hidden_dim_size=D,
                                           dtype_str="bfloat16", use_mla=False,
                                           num_physical_slots=C)
    client.call(Op.REGISTER_ENGINE_DRIVEN, [p], RegisterEngineDrivenContextResponse)
    return iid


def _raw_pickle_commit(client: ZmqClient, iid: int, name: str, toks: list[int],
                       chunks: list[torch.Tensor]) -> bool:
    key = IPCCacheServerKey(model_name=name, world_size=1, worker_id=0, token_ids=toks, start=0,
                            end=len(chunks) * C, request_id=f"raw-{secrets.token_hex(4)}")
    ok = client.call(Op.COMMIT_STORE, [key, iid], None, raw=[codec.encode(dumps_chunks(chunks))])
    client.call(Op.END_SESSION, [key.request_id])
    return bool(ok)


def test_pickle_commit_true_while_nothing_stored(small_pickle_own: Model) -> None:
    """docs/protocol.md §10.4 with the raw protocol (the server's word), then the SDK's (the truth)."""
    m, srv = small_pickle_own, small_pickle_own.server
    assert not srv.shm
    client = ZmqClient(srv.url, srv.generation, 30)
    try:
        iid = _raw_register(client, m.name)
        with lkf.connect(srv.url, srv.http_url, m.name, timeout=30) as ctx:
            # 1. L1 cannot hold the request: the server says True, stores nothing
            n = L1_BYTES // CHUNK_BYTES + 20
            toks, kv = rand_tokens(n * C, seed=5), m.kv(n * C, seed=5)
            chunks = [kv[:, :, i * C:(i + 1) * C].contiguous() for i in range(n)]
            assert _raw_pickle_commit(client, iid, m.name, toks, chunks) is True
            assert ctx.lookup(toks) == 0
            del chunks
            assert ctx.store(kv, toks) is False  # the SDK does not repeat the lie
            # 2. a failed commit (wrong chunk shape) leaves the keys staged: a retry of
            #    the same keys is "True" on the wire and stores nothing
            toks2, kv2 = rand_tokens(2 * C, seed=6), m.kv(2 * C, seed=6)
            bad = [torch.zeros(2, L, C // 2, 2 * D, dtype=torch.bfloat16)] * 2
            assert _raw_pickle_commit(client, iid, m.name, toks2, bad) is False
            good = [kv2[:, :, i * C:(i + 1) * C].contiguous() for i in range(2)]
            assert _raw_pickle_commit(client, iid, m.name, toks2, good) is True
            assert ctx.lookup(toks2) == 0
            res = ctx.store_ex(kv2, toks2)
            assert res.ok is False and res.chunks_refused == 2 and res.tokens_stored == 0
            assert ctx.retrieve(toks2) is None
        client.call(Op.UNREGISTER_ENGINE_DRIVEN, [iid])
    finally:
        client.close()
