"""Interop with the upstream SDK (``lmcache.sdk``, the oracle): bit-exact both ways.

The oracle is the server version's own SDK: the main venv's ``lmcache`` in-process for its
0.5.6 server, that version's in a child process of its venv for another
(``LMCACHE_KV_FAST_TEST_SERVER``, ``testbed.compat.TheirContext``).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from conftest import make_model, rand_tokens

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast.testing import LMCacheServer
from testbed.compat import TheirContext

C = 256
upstream = pytest.importorskip("lmcache.sdk.kvcache")


def their_connect(server: LMCacheServer, model: str) -> Any:
    """The server version's own SDK context for ``model``."""
    if server.version is not None and server.python != sys.executable:
        return TheirContext(server.version, server.url, server.http_url, model, timeout=30)
    return upstream.connect(server.url, server.http_url, model, timeout=30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_upstream_store_ours_retrieve_and_reverse(server, dtype):
    m = make_model(server, dtype=dtype, num_layers=4, num_kv_heads=8, head_size=64)
    theirs = their_connect(server, m.name)
    ours = lmc_sdk.connect(server.url, server.http_url, m.name, timeout=30)
    try:
        # upstream -> ours
        toks_a = rand_tokens(3 * C, seed=31)
        kv_a = m.kv(3 * C, seed=32)
        assert theirs.store(kv_a, toks_a)
        got = ours.retrieve(toks_a)
        assert got is not None and torch.equal(got.view(torch.uint8), kv_a.view(torch.uint8))
        # ours -> upstream
        toks_b = rand_tokens(2 * C + 17, seed=33)
        kv_b = m.kv(2 * C + 17, seed=34)
        assert ours.store(kv_b, toks_b)
        got_b = theirs.retrieve(toks_b)
        assert got_b is not None
        assert torch.equal(got_b.view(torch.uint8), kv_b[:, :, : 2 * C].contiguous().view(torch.uint8))
        # salts agree too
        assert ours.store(kv_a[:, :, :C].contiguous(), toks_a[:C], cache_salt="s1")
        assert torch.equal(theirs.retrieve(toks_a[:C], cache_salt="s1"), kv_a[:, :, :C])
    finally:
        ours.close()
        theirs.close()


def test_upstream_mla_store_ours_retrieve(server):
    # The upstream SDK cannot store MLA (docs/protocol.md §11 #11); ours stores, theirs retrieves.
    m = make_model(server, mla=True, num_layers=2, head_size=576)
    toks = rand_tokens(C, seed=35)
    kv = m.kv(C, seed=36)
    theirs = their_connect(server, m.name)
    ours = lmc_sdk.connect(server.url, server.http_url, m.name, timeout=30)
    try:
        assert ours.store(kv, toks)
        got = theirs.retrieve(toks)
        assert got is not None
        assert torch.equal(got.reshape(kv.shape), kv)
    finally:
        ours.close()
        theirs.close()
