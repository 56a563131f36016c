"""connect(): fails fast and clearly for each thing that can be wrong."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_model, unique_model_name

import lmcache_kv_fast as lkf
import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.testing import LMCacheServer, free_port


def test_unreachable_http_fails_fast():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(lkf.KVCacheSDKError, match="failed"):
        lmc_sdk.connect(f"tcp://127.0.0.1:{free_port()}", f"http://127.0.0.1:{port}", "m",
                        timeout=60)
    assert time.monotonic() - t0 < 6


def test_nothing_answers_noop_fails_fast(server_shm):
    t0 = time.monotonic()
    with pytest.raises(lkf.KVCacheSDKError, match="noop"):
        lmc_sdk.connect(f"tcp://127.0.0.1:{free_port()}", server_shm.http_url, "m", timeout=60)
    assert time.monotonic() - t0 < 7


def test_model_without_layout(server_shm):
    name = unique_model_name("nolayout")
    with pytest.raises(lkf.KVCacheSDKError, match="no registered KV layout") as ei:
        lmc_sdk.connect(server_shm.url, server_shm.http_url, name, timeout=10)
    assert "KVLayout" in str(ei.value)


def test_lmcache_driven_server_refused():
    srv = LMCacheServer(shm=False, l1_size_gb=0.25)
    # the CLI default mode: no engine-driven transfers
    srv.command = lambda _orig=srv.command: [a if a != "auto" else "lmcache_driven" for a in _orig()]
    with srv:
        assert _proc_env(srv.proc.pid).get("MALLOC_ARENA_MAX") == "1"  # tuned by default
        with pytest.raises(lkf.KVCacheSDKError, match="supported-transfer-mode"):
            lmc_sdk.connect(srv.url, srv.http_url, "m", timeout=10)
    # the server's temporary log file goes with it
    assert srv.log_path is not None and not srv.log_path.exists()


def _proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)


def test_server_log_kept_on_request_and_untuned_malloc(monkeypatch):
    monkeypatch.setenv("LMCACHE_KV_FAST_KEEP_SERVER_LOGS", "1")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")  # the caller's own setting wins
    tuned = LMCacheServer().server_env
    assert tuned["MALLOC_ARENA_MAX"] == "1" and "MALLOC_TRIM_THRESHOLD_" not in tuned
    srv = LMCacheServer(shm=False, l1_size_gb=0.25, malloc_tuning=False)
    assert not any(k.startswith("MALLOC_") for k in srv.server_env)
    assert srv.keep_log and not LMCacheServer(keep_log=False).keep_log
    try:
        with srv:
            env = _proc_env(srv.proc.pid)
            assert "MALLOC_ARENA_MAX" not in env and env["MALLOC_TRIM_THRESHOLD_"] == "12345"
            assert srv.log_path is not None and srv.log_path.exists()
        assert srv.log_path.exists() and srv.log_path.stat().st_size > 0
    finally:
        if srv.log_path is not None:
            srv.log_path.unlink(missing_ok=True)


@pytest.mark.parametrize("kw, match", [
    (dict(url="localhost:5555"), "url"),
    (dict(url="tcp://127.0.0.1"), "url"),
    (dict(http_url="127.0.0.1:8080"), "http_url"),
    (dict(http_url="ftp://x:1"), "http_url"),
    (dict(model_name=""), "model_name"),
    (dict(model_name="a@b"), "model_name"),
    (dict(model_name="m\ud800"), "model_name must be valid Unicode"),
    (dict(model_name="m\ud800", layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                                                dtype="bfloat16")), "model_name"),
    (dict(copy_threads=100_000), r"copy_threads must be an int in \[1, 1024\]"),
    (dict(url="tcp://127.0.0.1:1\n"), "url must look like .* ends with a newline"),
    (dict(url="tcp://*:1"), "wildcard"),
    (dict(timeout=0), "timeout"),
    (dict(timeout=float("nan")), "timeout"),
    (dict(timeout="5"), "timeout"),
])
def test_malformed_arguments(kw, match):
    args = dict(url="tcp://127.0.0.1:1", http_url="http://127.0.0.1:1", model_name="m",
                timeout=5.0)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        lmc_sdk.connect(**args)


def test_connect_and_context_manager(server):
    m = make_model(server)
    with lmc_sdk.connect(server.url, server.http_url, m.name) as ctx:
        assert not ctx.closed
        assert ctx.layout.num_layers == m.num_layers
    assert ctx.closed


def test_import_never_loads_lmcache():
    code = (
        "import sys, lmcache_kv_fast, lmcache_kv_fast.kvcache\n"
        "bad = [m for m in sys.modules if m == 'lmcache' or m.startswith('lmcache.')]\n"
        "assert not bad, bad\nprint('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


# ---------------------------------------------------------------------- a CPU engine's model
TINY_CONFIG = {  # a Llama config.json: 2 layers, 2 KV heads x 64, bfloat16
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "torch_dtype": "bfloat16", "vocab_size": 1024,
}


def _bits(t):
    return t.contiguous().view(torch.int16)


def test_engine_driven_model_connects_and_converts(server):
    """A CPU engine's registration (engine-driven only) + the model's config: plain connect
    finds the geometry; retrieve/store move per-token K/V, raw=True the engine's rows."""
    from lmcache_kv_fast.layout import CpuEngineKV
    from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven

    name = unique_model_name("cpu-engine")
    cpu = CpuEngineKV(2, 2, 64, torch.bfloat16, 128, "vec")
    iid = register_engine_driven(server.url, name, block_size=128, use_mla=True, hidden=256)
    try:
        with lmc_sdk.connect(server.url, server.http_url, name, timeout=30,
                             model_config=TINY_CONFIG, kernel="vec") as ctx:
            assert ctx.engine_kv == cpu
            assert ctx.layout == cpu.token_layout and ctx.raw_layout == cpu.raw_layout
            assert ctx.kv_shape(512) == (2, 2, 512, 128)
            assert ctx.kv_shape(512, raw=True) == (2, 512, 256)
            toks = list(range(7, 7 + 600))
            g = torch.Generator().manual_seed(5)
            kv = torch.randint(-2**15, 2**15 - 1, (2, 2, 600, 128), generator=g,
                               dtype=torch.int16).view(torch.bfloat16)  # NaNs included
            assert lmc_sdk.store(ctx, kv, toks)  # per-token in; 512 whole-chunk tokens kept
            assert ctx.lookup(toks) == 512
            raw = lmc_sdk.retrieve(ctx, toks, raw=True)
            assert raw is not None and torch.equal(_bits(raw), _bits(cpu.to_raw(kv[:, :, :512])))
            got = lmc_sdk.retrieve(ctx, toks)
            assert got is not None and torch.equal(_bits(got), _bits(kv[:, :, :512]))
            out = torch.zeros(2, 2, 768, 128, dtype=torch.bfloat16)
            got = ctx.retrieve(toks, out=out)
            assert got is not None and torch.equal(_bits(got), _bits(kv[:, :, :512]))
            assert ctx.last_timing is not None and ctx.last_timing.chunks == 2
            # the raw rows stored back under other tokens read back per-token exactly
            other = [t + 1 for t in toks[:512]]
            assert ctx.store(raw, other, raw=True)
            assert torch.equal(_bits(ctx.retrieve(other)), _bits(kv[:, :, :512]))
            # per-token tensors are refused in raw mode and vice versa, with the shapes
            with pytest.raises(lkf.InvalidArgumentError, match=r"\[2, 2, T, 128\]"):
                ctx.store(raw, other)
            with pytest.raises(lkf.InvalidArgumentError, match=r"\[2, T, 256\]"):
                ctx.store(kv, toks, raw=True)
            with pytest.raises(lkf.InvalidTypeError, match="raw"):
                ctx.retrieve(toks, raw=1)
            # batch functions hand the per-token KV to the user's fn
            from lmcache_kv_fast import batch

            seen = []

            def fn(k, t):
                seen.append(tuple(k.shape))
                return k, t

            rep = batch.rewrite(ctx, [toks], fn, progress=False)
            assert rep.ok == 1 and seen == [(2, 2, 512, 128)]
    finally:
        unregister_engine_driven(server.url, iid)


def test_engine_driven_model_without_config_says_what_to_pass(server_shm):
    from lmcache_kv_fast.testing.register import register_engine_driven, unregister_engine_driven

    name = "acme/" + unique_model_name("no-config")
    iid = register_engine_driven(server_shm.url, name, block_size=128, use_mla=True)
    try:
        with pytest.raises(lkf.KVCacheSDKError, match="model_config=") as ei:
            lmc_sdk.connect(server_shm.url, server_shm.http_url, name, timeout=10)
        msg = str(ei.value)
        assert "no registered KV layout" in msg and "config.json" in msg and "layout=" in msg
        with pytest.raises(lkf.InvalidArgumentError, match="block_size"):
            lmc_sdk.connect(server_shm.url, server_shm.http_url, name, timeout=10, block_size=0)
    finally:
        unregister_engine_driven(server_shm.url, iid)
