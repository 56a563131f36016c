"""connect() against a real CPU engine with nothing but the model name: how the engine's
registration is told from other SDKs', and what the errors ask for when it cannot be."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import lmcache_kv_fast as lkf
from lmcache_kv_fast.layout import EngineLayoutUnresolvedError, KVLayout, resolve_engine_layout
from testbed.engine_proc import KEEP_LOGS_ENV

from .common import BLOCK, CHUNK, register_engine_driven, tokens, unregister_engine_driven


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.fixture(scope="module")
def prompt_kv(offline_engine, sdk):
    """A prompt the engine prefilled and its per-token K/V as the ``sdk`` reads it."""
    p = tokens(2 * CHUNK + 8, 70)
    # 0 the first time; the engine-exited test runs last (after this module's teardown), so
    # the fixture is made again for it and the engine then finds the prompt cached
    assert offline_engine.generate([p])[0].num_cached_tokens in (0, 2 * CHUNK)
    kv = sdk.retrieve(p)
    assert kv is not None and kv.shape == (2, 2, 2 * CHUNK, 128)
    return p, kv


def test_connect_excludes_own_contexts_and_tolerates_upstreams(engine_server, model_name,
                                                                cpu_kv, prompt_kv):
    import lmcache.sdk.kvcache as upstream

    from lmcache_kv_fast.testing import register_vllm_layout

    p, kv = prompt_kv
    url, http = engine_server.url, engine_server.http_url
    # one of our own contexts of the same model with another geometry (block 16, 2 planes)
    other = lkf.connect(url, http, model_name, timeout=30,
                        layout=KVLayout(2, 2, 64, "bfloat16", block_size=16))
    # upstream's context: it registers too (it needs the layout supplied to connect)
    raw = cpu_kv.raw_layout
    reg = register_vllm_layout(url, model_name, num_layers=raw.num_layers, num_kv_heads=1,
                               head_size=raw.head_dim, dtype=raw.dtype_str, block_size=BLOCK,
                               layout="MLA")
    try:
        theirs = upstream.connect(url, http, model_name, timeout=30)
    finally:
        reg.unregister()
    try:
        st = engine_server.status()
        regs = [e for e in st["non_cuda_context_meta"].values() if e["model_name"] == model_name]
        assert len(regs) >= 4  # engine, the sdk fixture, `other`, upstream's
        assert {e["block_size"] for e in regs} == {16, BLOCK}
        # without excluding this process's own contexts the answer would be ambiguous
        with pytest.raises(EngineLayoutUnresolvedError, match="block_size="):
            resolve_engine_layout(st, model_name)
        with lkf.connect(url, http, model_name, timeout=30) as ctx:
            assert ctx.engine_kv == cpu_kv
            assert torch.equal(bits(ctx.retrieve(p)), bits(kv))
    finally:
        theirs.close()
        unregister_engine_driven(url, theirs.instance_id)
        other.close()


def test_foreign_disagreeing_registration_asks_for_block_size(engine_server, model_name,
                                                              cpu_kv, prompt_kv):
    p, kv = prompt_kv
    url, http = engine_server.url, engine_server.http_url
    iid = register_engine_driven(url, model_name, block_size=16, use_mla=False, hidden=128)
    try:
        with pytest.raises(lkf.KVCacheSDKError, match="disagree") as ei:
            lkf.connect(url, http, model_name, timeout=30)
        msg = str(ei.value)
        assert "block_size=" in msg and "model_config=" in msg and "layout=" in msg
        with lkf.connect(url, http, model_name, timeout=30, block_size=BLOCK) as ctx:
            assert ctx.engine_kv == cpu_kv
            assert torch.equal(bits(ctx.retrieve(p)), bits(kv))
    finally:
        unregister_engine_driven(url, iid)


def test_unresolvable_model_errors_say_what_to_pass(engine_server, tiny_model, cpu_kv):
    url, http = engine_server.url, engine_server.http_url
    # nobody registered the model: no vLLM, no engine
    with pytest.raises(lkf.KVCacheSDKError, match="no registered KV layout") as ei:
        lkf.connect(url, http, "acme/nobody-registered-this", timeout=30)
    msg = str(ei.value)
    for arg in ("model_config=", "block_size=", "dtype=", "layout="):
        assert arg in msg, (arg, msg)
    # an engine registered a model whose configuration cannot be found here
    name = "acme/unknown-llm"
    iid = register_engine_driven(url, name, block_size=BLOCK, use_mla=True)
    try:
        with pytest.raises(lkf.KVCacheSDKError, match="model_config=") as ei:
            lkf.connect(url, http, name, timeout=30)
        assert "config.json" in str(ei.value)
        cfg = json.loads((tiny_model / "config.json").read_text())
        for mc in (tiny_model, tiny_model / "config.json", cfg):
            with lkf.connect(url, http, name, timeout=30, model_config=mc) as ctx:
                assert ctx.engine_kv == cpu_kv
                assert ctx.layout == cpu_kv.token_layout
        with pytest.raises(lkf.InvalidTypeError, match="model_config"):
            lkf.connect(url, http, name, timeout=30, model_config=42)
    finally:
        unregister_engine_driven(url, iid)


@pytest.mark.stops_engine
def test_engine_exited_then_connect_needs_block_size(offline_engine, engine_server, model_name,
                                                     cpu_kv, prompt_kv, sdk):
    p, kv = prompt_kv
    url, http = engine_server.url, engine_server.http_url

    def foreign() -> set[str]:
        regs = engine_server.status()["non_cuda_context_meta"]
        own = {str(sdk.instance_id), str(sdk.writer_instance_id)}
        return {k for k, e in regs.items() if e["model_name"] == model_name and k not in own}

    before = foreign()
    assert before  # the engine's registration
    rpc = offline_engine.rpc_dir
    assert rpc is not None and any(p.is_socket() for p in rpc.iterdir())
    offline_engine.stop()  # the last engine test: the shared engine goes now
    if os.environ.get(KEEP_LOGS_ENV, "") in ("", "0"):  # else its files are kept on purpose
        assert not rpc.exists()  # its IPC sockets with it
    deadline = time.monotonic() + 60
    while foreign() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    # the engine unregisters when it shuts down cleanly; one killed after its grace period
    # (a loaded box) never does: no engine runs any more, so whatever is left is stale (the
    # server would reap it much later)
    for iid in foreign():
        unregister_engine_driven(url, int(iid))
    assert not foreign()
    with pytest.raises(lkf.KVCacheSDKError, match="no engine registration") as ei:
        lkf.connect(url, http, model_name, timeout=30)
    assert "block_size=" in str(ei.value) and "model_config=" in str(ei.value)
    # the KV is still in LMCache: described by block_size, read per-token as before
    with lkf.connect(url, http, model_name, timeout=30, block_size=BLOCK) as ctx:
        assert ctx.engine_kv == cpu_kv
        assert torch.equal(bits(ctx.retrieve(p)), bits(kv))
    assert torch.equal(bits(sdk.retrieve(p)), bits(kv))  # the open context keeps working


def test_engine_runs_the_test_servers_lmcache(engine_server, offline_engine):
    """The engine's connector and its server are of one LMCache version: the venv's own, or
    ``LMCACHE_KV_FAST_TEST_SERVER``'s (the suite's 0.5.7rc2 engine pass)."""
    import subprocess

    from testbed.engine_proc import child_env, engine_python, server_version

    want = server_version() or "0.5.6"
    probe = ("import importlib.metadata as m, lmcache, pathlib; "
             "print(m.version('lmcache') if 'site-packages' in lmcache.__file__ else "
             "pathlib.Path(lmcache.__file__).parents[1].name.removeprefix('lmcache-'))")
    got = subprocess.run([str(engine_python()), "-c", probe], env=child_env(), text=True,
                         capture_output=True, timeout=120).stdout.strip().splitlines()[-1]
    assert got == want
    assert engine_server.http().version().startswith(want)
