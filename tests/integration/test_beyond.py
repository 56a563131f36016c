"""Beyond the upstream SDK: explicit geometry, tensor-parallel shards, lookup, honest store
results, liveness, thread safety, instance ids (against the real server)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from conftest import make_model, new_server, rand_tokens, unique_model_name

import lmcache_kv_fast as lkf
import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import KVLayout
from lmcache_kv_fast.copy.torch_backend import open_segment
from lmcache_kv_fast.dataplane.envelope import EnvelopeFrameBuilder
from lmcache_kv_fast.dataplane.pickle_plane import dumps_chunks
from lmcache_kv_fast.protocol import codec
from lmcache_kv_fast.protocol.keys import make_key
from lmcache_kv_fast.protocol.ops import Generation, Op
from lmcache_kv_fast.protocol.types import (
    PrepareStoreResponse,
    RegisterEngineDrivenContextPayload,
    RegisterEngineDrivenContextResponse,
)
from lmcache_kv_fast.transport.zmq_client import ZmqClient

C = 256


def test_explicit_geometry_without_vllm(server):
    name = unique_model_name("explicit")
    lay = KVLayout(num_layers=3, num_kv_heads=4, head_dim=64, dtype=torch.float16)
    toks = rand_tokens(2 * C, seed=1)
    kv = torch.randn(2, 3, 2 * C, 256).half()
    with lmc_sdk.connect(server.url, server.http_url, name, layout=lay) as ctx:
        assert ctx.layout == lay
        assert ctx.store(kv, toks)
        assert torch.equal(ctx.retrieve(toks), kv)
    # a second, independent context sees the data
    with lmc_sdk.connect(server.url, server.http_url, name, layout=lay) as ctx2:
        assert ctx2.lookup(toks) == 2 * C


def test_explicit_geometry_mla(server):
    name = unique_model_name("explicit-mla")
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=576, dtype="bfloat16", mla=True)
    toks = rand_tokens(C, seed=2)
    kv = torch.randn(2, C, 576).bfloat16()
    with lmc_sdk.connect(server.url, server.http_url, name, layout=lay) as ctx:
        assert ctx.store(kv, toks)
        assert torch.equal(ctx.retrieve(toks), kv)


def test_explicit_geometry_must_agree_with_vllm(server_shm):
    m = make_model(server_shm, num_layers=4, num_kv_heads=8, head_size=128)
    good = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name, layout=good) as ctx:
        assert ctx.layout == good
    bad = KVLayout(num_layers=5, num_kv_heads=8, head_dim=64, dtype=torch.float16)
    with pytest.raises(lkf.KVCacheSDKError) as ei:
        lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name, layout=bad)
    msg = str(ei.value)
    assert "num_layers" in msg and "head_dim" in msg and "dtype" in msg


def test_layout_after_handshake(server_shm):
    m = make_model(server_shm, num_layers=4, num_kv_heads=8, head_size=128)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        assert ctx.layout == KVLayout(num_layers=4, num_kv_heads=8, head_dim=128,
                                      dtype=torch.bfloat16, block_size=16)


@pytest.mark.parametrize("explicit", [False, True])
def test_tensor_parallel_w2_roundtrip(server, explicit):
    if explicit:
        name = unique_model_name("tp2x")
        kw = dict(layout=KVLayout(num_layers=3, num_kv_heads=8, head_dim=64,
                                  dtype=torch.bfloat16), world_size=2)
    else:
        name = make_model(server, layout="HND", world_size=2, num_layers=3, num_kv_heads=8,
                          head_size=64).name
        kw = {}
    toks = rand_tokens(2 * C, seed=3)
    kv = torch.randn(2, 3, 2 * C, 512).bfloat16()
    with lmc_sdk.connect(server.url, server.http_url, name, **kw) as ctx:
        assert ctx.world_size == 2
        assert ctx.store(kv, toks)
        got = ctx.retrieve(toks)
        assert torch.equal(got, kv)
        assert ctx.lookup(toks) == 2 * C
    st = server.status()
    assert st["storage_manager"]["l1_manager"]["read_locked_count"] == 0


def _raw_register(client: ZmqClient, name: str, ws: int, layers: int, hidden: int) -> tuple[int, str]:
    iid = random.getrandbits(62) + 1
    p = RegisterEngineDrivenContextPayload(instance_id=iid, model_name=name, world_size=ws,
                                           block_size=16, num_layers=layers,
                                           hidden_dim_size=hidden, dtype_str="bfloat16",
                                           use_mla=False, num_physical_slots=C)
    r = client.call(Op.REGISTER_ENGINE_DRIVEN, [p], RegisterEngineDrivenContextResponse)
    return iid, r.shm_name


def _inline_frame(gen: Generation, chunk: torch.Tensor) -> bytes:
    """One chunk as the inline plane's commit_store frame: pickled, or a 0.5.7 envelope."""
    if not gen.inline_envelope:
        return codec.encode(dumps_chunks([chunk]))
    _backing, frame, (off,) = EnvelopeFrameBuilder(tuple(chunk.shape), chunk.dtype).build(1)
    raw = chunk.reshape(-1).view(torch.uint8).numpy().tobytes()
    frame[off:off + len(raw)] = raw
    return bytes(frame)


def test_tp_interop_with_per_rank_stores(server):
    """Data stored shard by shard as vLLM workers store it (worker_id=r keys of per-rank
    tensors) comes back as the full tensor; ours stored is readable per rank."""
    m = make_model(server, layout="HND", world_size=2, num_layers=2, num_kv_heads=4, head_size=64)
    toks = rand_tokens(C, seed=4)
    kv = torch.randn(2, 2, C, 256).bfloat16()
    client = ZmqClient(server.url, server.generation, 20)
    try:
        iid, shm = _raw_register(client, m.name, 2, 2, 128)
        seg = open_segment(shm) if shm else None
        for r in range(2):
            shard = kv[..., r * 128:(r + 1) * 128].contiguous()
            key = make_key(server.generation, model_name=m.name, world_size=2, worker_id=r,
                           tokens=toks, start=0, end=C, request_id=f"rank{r}-{iid}")
            if seg is not None:
                resp = client.call(Op.PREPARE_STORE, [key, iid], PrepareStoreResponse)
                (reg,) = seg.regions(resp.context.slots, shard.numel() * 2, 4096)
                reg.tensor.view(torch.bfloat16).copy_(shard.reshape(-1))
                assert client.call(Op.COMMIT_STORE, [key, iid], None, raw=[codec.encode(b"")])
            else:
                assert client.call(Op.COMMIT_STORE, [key, iid], None,
                                   raw=[_inline_frame(server.generation, shard)])
            client.call(Op.END_SESSION, [key.request_id])
        with lmc_sdk.connect(server.url, server.http_url, m.name) as ctx:
            assert torch.equal(ctx.retrieve(toks), kv)
        client.call(Op.UNREGISTER_ENGINE_DRIVEN, [iid])
        if seg is not None:
            seg.close()
    finally:
        client.close()


def test_tp_heads_not_divisible(server_shm):
    lay = KVLayout(num_layers=2, num_kv_heads=6, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="divisible|world_size"):
        lmc_sdk.connect(server_shm.url, server_shm.http_url, unique_model_name(), layout=lay,
                        world_size=4)


def test_lookup_moves_no_data_and_releases(server):
    m = make_model(server)
    with lmc_sdk.connect(server.url, server.http_url, m.name) as ctx:
        toks = rand_tokens(3 * C + 7, seed=5)
        assert ctx.lookup(toks) == 0
        assert ctx.store(m.kv(3 * C + 7), toks)
        assert lmc_sdk.lookup(ctx, toks) == 3 * C
        assert ctx.lookup(toks[:C + 3]) == C
        assert ctx.lookup(toks[:10]) == 0
        st = server.settled_status()
        assert st["active_sessions"] == 0 and st["active_prefetch_jobs"] == 0
        assert st["storage_manager"]["l1_manager"]["read_locked_count"] == 0


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "pickle"])
def test_honest_store_when_l1_full(shm):
    """L1 full: store returns False (upstream: pickle says True, SHM cannot tell)."""
    with new_server(shm=shm, l1_size_gb=0.0625) as srv:  # 64 MiB
        m = make_model(srv, num_layers=4, num_kv_heads=8, head_size=128)  # 4 MiB / chunk
        with lmc_sdk.connect(srv.url, srv.http_url, m.name) as ctx:
            toks = rand_tokens(20 * C, seed=6)  # 80 MiB > L1
            res = ctx.store_ex(m.kv(20 * C), toks)
            assert not res.ok and ctx.store(m.kv(20 * C), toks) is False
            assert res.chunks_refused > 0
            assert res.chunks_written + res.chunks_already_cached + res.chunks_refused == 20
            small = rand_tokens(2 * C, seed=7)
            r2 = ctx.store_ex(m.kv(2 * C, seed=8), small)
            assert r2.ok and r2.chunks_written == 2
            assert torch.equal(ctx.retrieve(small), m.kv(2 * C, seed=8))


def test_instance_ids_random_63_bit(server_shm):
    m = make_model(server_shm)
    ids = set()
    for _ in range(3):
        with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
            assert 0 < ctx.instance_id < 2**63
            ids.add(ctx.instance_id)
    assert len(ids) == 3


def test_heartbeat_keeps_idle_client_alive():
    """Server with a 30 s reap timeout: an idle client that pings survives > 40 s; a client
    whose heartbeat stopped (as if dead) is reaped."""
    with new_server(shm=True, l1_size_gb=0.25,
                    extra_args=["--worker-reap-timeout-seconds", "30"]) as srv:
        m = make_model(srv, num_layers=2, num_kv_heads=2, head_size=64)
        alive = lmc_sdk.connect(srv.url, srv.http_url, m.name)
        dead = lmc_sdk.connect(srv.url, srv.http_url, m.name)
        try:
            assert dead.ping()
            dead._hb_stop.set()  # simulate a dead client: no more pings
            time.sleep(45)
            regs = srv.status()["non_cuda_context_meta"]
            assert str(alive.instance_id) in regs
            assert str(dead.instance_id) not in regs
            toks = rand_tokens(C, seed=9)
            assert alive.store(m.kv(C), toks)
        finally:
            alive.close()
            dead.close()


def test_thread_safety_stress(server):
    """8 threads x 200 mixed ops on one shared context: 0 mismatches, nothing left over."""
    m = make_model(server, num_layers=2, num_kv_heads=2, head_size=64)  # 512 KiB / chunk
    seqs = [(rand_tokens(C * (1 + i % 2), seed=1000 + i), m.kv(C * (1 + i % 2), seed=2000 + i))
            for i in range(16)]
    errors: list[str] = []
    counts = {"store": 0, "retrieve": 0, "lookup": 0}
    lock = threading.Lock()
    with lmc_sdk.connect(server.url, server.http_url, m.name) as ctx:
        def worker(wid: int) -> None:
            rng = random.Random(wid)
            for _ in range(200):
                i = rng.randrange(len(seqs))
                toks, kv = seqs[i]
                op = rng.choice(("store", "retrieve", "lookup"))
                try:
                    if op == "store":
                        if not ctx.store(kv, toks):
                            errors.append(f"store {i} returned False")
                    elif op == "retrieve":
                        got = ctx.retrieve(toks)
                        if got is not None and not torch.equal(got, kv[:, :, :got.shape[2]]):
                            errors.append(f"mismatch on {i}")
                    else:
                        ctx.lookup(toks)
                except Exception as err:
                    errors.append(f"{op} {i}: {err!r}")
                with lock:
                    counts[op] += 1
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        # everything stored is retrievable, bit-exact
        for toks, kv in seqs:
            if ctx.lookup(toks):
                assert torch.equal(ctx.retrieve(toks), kv)
    assert errors == []
    assert sum(counts.values()) == 1600
    st = server.settled_status()
    assert st["active_sessions"] == 0 and st["active_prefetch_jobs"] == 0
    l1 = st["storage_manager"]["l1_manager"]
    assert l1["read_locked_count"] == 0 and l1["write_locked_count"] == 0


def test_last_timing_breaks_each_call_down(server, model):
    """``ctx.last_timing``: per thread, per call; waits + copies + the rest = the call."""
    toks, kv = rand_tokens(3 * C, seed=11), model.kv(3 * C, seed=11)
    with lmc_sdk.connect(server.url, server.http_url, model.name) as ctx:
        assert ctx.last_timing is None
        t0 = time.perf_counter()
        assert ctx.store(kv, toks)
        outer = time.perf_counter() - t0
        st = ctx.last_timing
        assert st is not None and st.op == "store" and st.chunks == 3
        assert 0 < st.total_s <= outer
        assert st.rpcs >= 1 and st.wait_s > 0 and st.copy_s > 0
        assert st.wait_s + st.copy_s <= st.total_s
        assert st.client_s == pytest.approx(st.total_s - st.wait_s - st.copy_s)
        assert ctx.lookup(toks) == 3 * C
        lk = ctx.last_timing
        assert lk.op == "lookup" and lk.copy_s == 0 and lk.chunks == 0 and lk.rpcs >= 2
        out = torch.zeros_like(kv)
        ctx.retrieve(toks, out=out)
        assert torch.equal(out, kv)
        rt = ctx.last_timing
        assert rt.op == "retrieve" and rt.chunks == 3 and rt.copy_s > 0
        assert rt.rpcs >= 3  # lookup, wait, prepare (+ commit on SHM)
        assert set(rt.as_dict()) == {"op", "total_s", "wait_s", "copy_s", "alloc_s", "client_s",
                                     "rpcs", "chunks", "hinted", "rehinted"}
        assert ctx.retrieve(rand_tokens(C, seed=12)) is None  # a miss moves nothing
        assert ctx.last_timing.chunks == 0 and ctx.last_timing.copy_s == 0
        seen: list[object] = []
        th = threading.Thread(target=lambda: seen.append(ctx.last_timing))
        th.start()
        th.join()
        assert seen == [None]  # another thread has its own
