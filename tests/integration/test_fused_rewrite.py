"""batch.rewrite's fused path on the real server: a library edit's rows go slot to slot.

The reference is the same edit on tensors (what the tensor path stores): V and plain
gathers bit-exact, a single re-rotation bit-exact too (the core rounds as torch does), a
chain's one combined rotation within a bf16 ulp. On the inline plane and for edits the
library cannot plan the tensor path runs, and the report says which path ran. A CPU
engine's rows (registered engine-driven as the engine's connector does; the engine
itself: tests/engine/test_engine_fused.py) are rewritten in the kernel's element order
(``fused_blocks``): read back per token they are the tensor edit's, and raw they are the
converter's rows of it.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from conftest import make_model, rand_tokens, unique_model_name

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import _native, batch, edits
from lmcache_kv_fast.batch import RewriteEngine
from lmcache_kv_fast.copy import backend
from lmcache_kv_fast.layout import CpuEngineKV
from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven

C = 256
HEAD = 128
SPIN = "import os, time\nend = time.time() + 60\nwhile time.time() < end:\n    os.sched_yield()\n"
ROPE_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE = edits.rope_from_config({
    "rope_theta": 500000.0, "head_dim": HEAD, "hidden_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rope_scaling": ROPE_SCALING,
})


@pytest.fixture
def wide(server):
    """4 layers x 8 heads x 128 bf16 (D = 1024), a fresh L1."""
    m = make_model(server, num_layers=4, num_kv_heads=8, head_size=HEAD)
    ctx = lmc_sdk.connect(server.url, server.http_url, m.name)
    ctx.clear(force=True)
    yield m, ctx
    ctx.close()


def _seed(m, ctx, n, seed, tokens=3 * C):
    toks = [rand_tokens(tokens, seed=seed + i) for i in range(n)]
    kvs = [m.kv(tokens, seed=seed + 50 + i) for i in range(n)]
    for t, kv in zip(toks, kvs, strict=True):
        assert ctx.store(kv, t)
    return toks, kvs


def _same_bits(got: torch.Tensor, want: torch.Tensor, plane: str) -> None:
    """Assert equal bytes; else say where (layer, token, dim) and by how much they differ."""
    bad = got.view(torch.int16) != want.view(torch.int16)
    if not bool(bad.any()):
        return
    where = bad.nonzero()
    diff = (got.float() - want.float())[bad].abs()
    raise AssertionError(
        f"{plane}: {where.shape[0]} of {bad.numel()} elements differ, first at (layer, token, "
        f"dim) {where[:4].tolist()}, last {where[-1].tolist()}; largest difference "
        f"{diff.max().item():.3g}, got {got[bad][:4].tolist()} want {want[bad][:4].tolist()}")


def _check(ctx, fn, toks, kvs, *, exact=True, hit=3 * C):
    """Each rewritten sequence reads back as ``fn`` computes it on the tensors."""
    for t, kv in zip(toks, kvs, strict=True):
        want, want_toks = fn(kv[:, :, :hit].contiguous(), t[:hit])
        n = len(want_toks) // C * C
        got = ctx.retrieve(want_toks)
        assert got is not None and got.shape[2] == n
        _same_bits(got[1], want[1, :, :n], "V")
        if exact:
            _same_bits(got[0], want[0, :, :n], "K")
        else:  # one combined rotation vs the chain's two: bf16 rounding apart
            torch.testing.assert_close(got[0].float(), want[0, :, :n].float(),
                                       rtol=2 ** -7, atol=2 ** -6)


def _settled(server):
    st = server.settled_status(timeout=10.0)
    l1 = st["storage_manager"]["l1_manager"]
    return st["active_sessions"], l1["read_locked_count"], l1["write_locked_count"]


@pytest.mark.parametrize("fn", [edits.drop_every(10), edits.drop_every(10, rope=ROPE),
                                edits.streaming_llm(4, 400, rope=ROPE),
                                edits.keep_ratio(0.6, "uniform", rope=ROPE)],
                         ids=["drop", "drop-rope", "streaming", "uniform"])
def test_library_edits_fused_on_shm_tensor_inline(wide, fn):
    m, ctx = wide
    toks, kvs = _seed(m, ctx, 3, 100)
    rep = batch.rewrite(ctx, toks, fn, progress=False)
    assert rep.ok == 3 and rep.failed == 0, rep.summary()
    fused = ctx.transport == "shm"  # the inline plane has no slots to read or fill
    assert (rep.fused, rep.tensor, rep.path) == ((3, 0, "fused") if fused else (0, 3, "tensor"))
    assert "path fused" in rep.summary() if fused else "path tensor" in rep.summary()
    _check(ctx, fn, toks, kvs)
    assert _settled(m.server) == (0, 0, 0)


def test_chain_is_one_pass_within_a_bf16_ulp(wide):
    m, ctx = wide
    fn = edits.chain(edits.drop_every(7, rope=ROPE), edits.streaming_llm(8, 500, rope=ROPE))
    toks, kvs = _seed(m, ctx, 2, 200)
    rep = batch.rewrite(ctx, toks, fn, progress=False)
    assert rep.ok == 2, rep.summary()
    assert rep.fused == (2 if ctx.transport == "shm" else 0)
    _check(ctx, fn, toks, kvs, exact=False)


def test_plain_functions_and_scored_edits_keep_the_tensor_path(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=8, head_size=HEAD)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        toks, kvs = _seed(m, ctx, 2, 300)

        def plain(kv, tokens):
            return edits.drop_every(10)(kv, tokens)

        for fn in (plain, edits.key_norm(0.5, head_dim=HEAD, rope=ROPE)):
            rep = batch.rewrite(ctx, toks, fn, progress=False)
            assert rep.ok == 2 and (rep.fused, rep.tensor) == (0, 2), rep.summary()
            _check(ctx, fn, toks, kvs)


def test_items_report_their_path_misses_and_edit_errors(server_shm):
    m = make_model(server_shm, num_layers=4, num_kv_heads=8, head_size=HEAD)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        _items_report(m, ctx)


def _items_report(m, ctx):
    toks, kvs = _seed(m, ctx, 2, 400)
    fn = edits.keep(range(0, 2 * C + 10))  # past the end of a 2-chunk item
    short = toks[0][: 2 * C]
    items = [toks[1], rand_tokens(2 * C, seed=9), short]
    got = list(RewriteEngine(ctx, fn).results(items))
    assert [r.status for r in got] == ["ok", "missed", "failed"]
    assert got[0].path == "fused" and got[0].value == toks[1][: 2 * C + 10]
    assert got[2].stage == "fn" and "out of range" in got[2].reason
    assert got[0].stages.keys() >= {"retrieve", "fn", "store", "copy"}
    assert got[0].tokens == 3 * C + 2 * C and got[0].nbytes > 0
    _check(ctx, fn, [toks[1]], [kvs[1]])
    assert _settled(m.server) == (0, 0, 0)


def test_keeping_everything_stores_nothing_new(wide):
    m, ctx = wide
    toks, kvs = _seed(m, ctx, 1, 500)
    rep = batch.rewrite(ctx, toks, edits.keep(range(3 * C)), progress=False)
    assert rep.ok == 1, rep.summary()
    assert torch.equal(ctx.retrieve(toks[0]).view(torch.int16), kvs[0].view(torch.int16))


def test_tensor_parallel_shards(server_shm):
    m = make_model(server_shm, num_layers=2, num_kv_heads=8, head_size=HEAD, world_size=2)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name, world_size=2) as ctx:
        toks = [rand_tokens(2 * C, seed=600)]
        kv = m.kv(2 * C, seed=601)
        assert ctx.store(kv, toks[0])
        fn = edits.drop_every(5, rope=ROPE)  # each shard: 4 of the 8 heads, rotated alone
        rep = batch.rewrite(ctx, toks, fn, progress=False)
        assert rep.ok == 1 and rep.fused == 1, rep.summary()
        _check(ctx, fn, toks, [kv], hit=2 * C)


def test_single_plane_models_get_the_edits_own_error(server_shm):
    m = make_model(server_shm, num_layers=2, head_size=HEAD, mla=True)
    with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
        toks = [rand_tokens(2 * C, seed=700)]
        assert ctx.store(m.kv(2 * C, seed=701), toks[0])
        rep = batch.rewrite(ctx, toks, edits.drop_every(5), progress=False)
        assert rep.failed == 1 and rep.errors[0].stage == "fn", rep.summary()
        assert "[2, L, T, D]" in rep.errors[0].reason
        assert _settled(m.server) == (0, 0, 0)


#: A Llama config.json: 2 layers, 2 KV heads x 128, bfloat16 (the engine's rows 512 wide).
ENGINE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": HEAD, "torch_dtype": "bfloat16", "vocab_size": 1024,
    "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": ROPE_SCALING,
}


@pytest.mark.parametrize("kernel", ["vec", "amx"])
def test_cpu_engine_rows_fused_in_the_kernels_order(server, kernel):
    name = unique_model_name("fused-engine")
    iid = register_engine_driven(server.url, name, block_size=128, use_mla=True,
                                 hidden=2 * 2 * HEAD)
    try:
        with lmc_sdk.connect(server.url, server.http_url, name, model_config=ENGINE_CONFIG,
                             kernel=kernel) as ctx:
            cpu = ctx.engine_kv
            assert cpu == CpuEngineKV(2, 2, HEAD, torch.bfloat16, 128, kernel)
            shm = ctx.transport == "shm"
            assert ctx.rewrites_rows == shm
            toks = [rand_tokens(3 * C, seed=800 + i) for i in range(2)]
            kvs = [torch.randn(2, 2, 3 * C, 2 * HEAD).to(torch.bfloat16) for _ in toks]
            for t, kv in zip(toks, kvs, strict=True):
                assert ctx.store(kv, t)
            rope = edits.rope_from_config(ENGINE_CONFIG)
            for fn in (edits.drop_every(10), edits.drop_every(7, rope=rope)):
                rep = batch.rewrite(ctx, toks, fn, progress=False)
                assert rep.ok == 2 and rep.path == ("fused" if shm else "tensor"), rep.summary()
                _check(ctx, fn, toks, kvs)
                want, kept = fn(kvs[0], toks[0])
                n = len(kept) // C * C
                raw = ctx.retrieve(kept, raw=True)
                assert torch.equal(raw.view(torch.int16),
                                   cpu.to_raw(want[:, :, :n]).view(torch.int16))
            assert _settled(server) == (0, 0, 0)
    finally:
        unregister_engine_driven(server.url, iid)


def test_copies_stay_on_their_threads_while_another_process_holds_a_core(server_shm):
    """With a process that never sleeps (vLLM's worker busy-polls a core after each step),
    the batch's census caps its copies at the free core: no copy is split over the pool
    (a pool thread there would wait behind the poller), and the bytes are the same."""
    m = make_model(server_shm, num_layers=4, num_kv_heads=8, head_size=HEAD)
    spin = subprocess.Popen([sys.executable, "-c", SPIN])
    threads, threshold = _native.get_threads(), _native.get_parallel_threshold()
    try:
        _native.set_threads(2)
        _native.set_parallel_threshold(64 << 10)  # every copy would go to the pool
        with lmc_sdk.connect(server_shm.url, server_shm.http_url, m.name) as ctx:
            toks, kvs = _seed(m, ctx, 3, 800)
            fn = edits.drop_every(10, rope=ROPE)
            engine = RewriteEngine(ctx, fn)
            native = backend().NAME == "native"  # the torch backend has no pool to cap
            assert engine.census.enabled == native, "the census cannot see this machine"
            time.sleep(0.2)
            jobs = _native.copy_stats()["pool_jobs"]
            got = list(engine.results(toks))
            assert _native.copy_stats()["pool_jobs"] == jobs
            assert engine.census.cap() == (1 if native else 0)
            assert [r.path for r in got] == ["fused"] * 3
            _check(ctx, fn, toks, kvs)
    finally:
        _native.set_threads(threads)
        _native.set_parallel_threshold(threshold)
        spin.kill()
        spin.wait(10)
