"""connect(): fails fast and clearly for each thing that can be wrong."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
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
