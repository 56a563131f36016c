"""A server newer than this SDK knows: the newest dialect is verified in seconds.

Real servers behind an HTTP proxy that reports a newer ``/version``: a real 0.5.7rc2
server posing as 0.5.8 speaks the newest dialect, so connect() verifies it and works; a
real 0.5.6 server posing as 0.5.8 does not, so connect() raises UnsupportedServerError
within 5 s naming the server's version and the versions this SDK knows.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from version_proxy import VersionProxy

import lmcache_kv_fast as lkf
from lmcache_kv_fast.errors import UnsupportedServerError
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.protocol.ops import NEWEST, known_versions
from lmcache_kv_fast.testing import LMCacheServer
from testbed.compat import missing_venv_hint, venv_python

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def _server(version: str) -> LMCacheServer:
    py = venv_python(version)
    if py is None:
        pytest.skip(missing_venv_hint(version))
    return LMCacheServer(shm=True, python=py, version=version, l1_size_gb=0.25)


def test_newer_server_speaking_the_newest_dialect_works(caplog):
    caplog.set_level(logging.WARNING)
    with (_server("0.5.7rc2") as srv, VersionProxy(srv.http_url, "0.5.8-gfeedbee") as px,
          lkf.connect(srv.url, px.url, "newer-ok", timeout=10, layout=LAYOUT) as ctx):
        toks = list(range(300, 300 + 512))
        kv = torch.randn(2, 2, 512, 128).to(torch.bfloat16)
        assert ctx.store(kv, toks)
        assert torch.equal(ctx.retrieve(toks), kv)
    assert "newer than this SDK knows" in caplog.text and NEWEST.name in caplog.text


@pytest.mark.parametrize("claimed", ["0.5.8-gfeedbee", "0.6.0"])
def test_newer_server_with_another_dialect_fails_fast(claimed):
    with _server("0.5.6") as srv, VersionProxy(srv.http_url, claimed) as px:
        t0 = time.monotonic()
        with pytest.raises(UnsupportedServerError) as ei:
            lkf.connect(srv.url, px.url, "newer-bad", timeout=60, layout=LAYOUT)
        took = time.monotonic() - t0
        msg = str(ei.value)
        assert took < 5, took
        assert claimed in msg and known_versions() in msg
        assert "not running" not in msg
        assert isinstance(ei.value, lkf.KVCacheSDKError)
        # nothing of the failed attempt is left registered on the server
        regs = srv.settled_status().get("non_cuda_context_meta") or {}
        assert not [r for r in regs.values() if r.get("model_name") == "newer-bad"]
