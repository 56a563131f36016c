"""API keys against a real key-protected LMCache 0.5.7rc2 server (``--api-key-file``).

The server answers 401 on its whole HTTP API (``/version`` included) without the key; the
SDK sends ``Authorization: Bearer`` from ``api_key=`` or ``LMCACHE_API_KEY`` /
``LMCACHE_API_KEY_FILE``, says clearly when a key is missing or wrong, and never shows it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import pytest
import torch

import lmcache_kv_fast as lkf
import lmcache_kv_fast.sdk as lmc_sdk
from lmcache_kv_fast.errors import AuthenticationError, InvalidArgumentError
from lmcache_kv_fast.events import EventsEndpoint
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.transport.api_key import resolve_api_key
from lmcache_kv_fast.transport.http import HttpInfoClient
from testbed.compat import missing_venv_hint, venv_python

VERSION = "0.5.7rc2"
KEY = "kvf-test-key-7f3a9c1e5b"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
KEY_VARS = ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY",
            "LMCACHE_HTTP_API_KEY_FILE")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    py = venv_python(VERSION)
    if py is None:
        pytest.skip(missing_venv_hint(VERSION))
    key_file = tmp_path_factory.mktemp("key") / "api.key"
    key_file.write_text(KEY + "\n")
    saved = {v: os.environ.pop(v, None) for v in KEY_VARS}
    # The fixture's own readiness checks read the key from the environment, like a user's.
    os.environ["LMCACHE_API_KEY_FILE"] = str(key_file)
    srv = LMCacheServer(shm=True, python=py, version=VERSION, l1_size_gb=0.25,
                        extra_args=["--api-key-file", str(key_file)])
    try:
        with srv:
            yield srv
    finally:
        for v, val in saved.items():
            os.environ.pop(v, None)
            if val is not None:
                os.environ[v] = val


@pytest.fixture
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in KEY_VARS:
        monkeypatch.delenv(v, raising=False)


def _roundtrip(ctx: lkf.LMCacheKVCacheContext) -> None:
    toks = list(range(7000, 7000 + 512))
    kv = torch.randn(2, 2, 512, 128).to(torch.bfloat16)
    assert ctx.store(kv, toks)
    out = ctx.retrieve(toks)
    assert out is not None and torch.equal(out, kv)


def test_key_from_environment_file(keyed_server):
    with lkf.connect(keyed_server.url, keyed_server.http_url, "key-env", timeout=10,
                     layout=LAYOUT) as ctx:
        assert ctx.api_key is not None and ctx.api_key.source.startswith("LMCACHE_API_KEY_FILE")
        _roundtrip(ctx)


def test_explicit_key_never_shown(keyed_server, no_env_key, caplog):
    caplog.set_level(logging.DEBUG)
    with lkf.connect(keyed_server.url, keyed_server.http_url, "key-arg", timeout=10,
                     layout=LAYOUT, api_key=KEY) as ctx:
        _roundtrip(ctx)
        shown = repr(ctx.api_key) + str(ctx.api_key) + repr(ctx) + repr(vars(ctx))
    assert KEY not in shown
    assert KEY not in caplog.text


def test_missing_key_is_clear_and_fast(keyed_server, no_env_key):
    t0 = time.monotonic()
    with pytest.raises(AuthenticationError) as ei:
        lkf.connect(keyed_server.url, keyed_server.http_url, "key-none", timeout=60,
                    layout=LAYOUT)
    assert time.monotonic() - t0 < 6
    msg = str(ei.value)
    assert "401" in msg and "requires an API key" in msg
    assert "api_key=" in msg and "LMCACHE_API_KEY" in msg
    assert isinstance(ei.value, lkf.KVCacheSDKError)


def test_wrong_key_is_clear_and_hidden(keyed_server, no_env_key):
    wrong = "not-the-key-31337"
    with pytest.raises(AuthenticationError) as ei:
        lkf.connect(keyed_server.url, keyed_server.http_url, "key-wrong", timeout=10,
                    layout=LAYOUT, api_key=wrong)
    msg = str(ei.value)
    assert "refused the API key from api_key=" in msg
    assert wrong not in msg and wrong not in repr(ei.value.args)


def test_wrong_key_from_environment_names_the_variable(keyed_server, no_env_key,
                                                       monkeypatch):
    monkeypatch.setenv("LMCACHE_API_KEY", "also-wrong-4242")
    with pytest.raises(AuthenticationError, match="from LMCACHE_API_KEY") as ei:
        lkf.connect(keyed_server.url, keyed_server.http_url, "key-wrong2", timeout=10,
                    layout=LAYOUT)
    assert "also-wrong-4242" not in str(ei.value)


def test_sdk_package_and_events_with_key(keyed_server, no_env_key):
    ctx = lmc_sdk.connect(lmc_sdk.LMCacheSDKCacheKind.KV, keyed_server.url,
                          keyed_server.http_url, "key-sdk", timeout=10, layout=LAYOUT,
                          api_key=KEY)
    try:
        toks = list(range(9000, 9000 + 256))
        kv = torch.randn(2, 2, 256, 128).to(torch.bfloat16)
        assert ctx.store(kv, toks)
        assert torch.equal(ctx.retrieve(toks), kv)
    finally:
        ctx.close()
    ep = EventsEndpoint.probe(keyed_server.url, keyed_server.http_url, "key-sdk",
                              api_key=KEY)
    assert ep.server_version.startswith("0.5.7") and KEY not in repr(ep)
    with pytest.raises(AuthenticationError):
        EventsEndpoint.probe(keyed_server.url, keyed_server.http_url, "key-sdk")


def test_public_routes_need_no_key(keyed_server, no_env_key):
    http = HttpInfoClient(keyed_server.http_url, 5.0)
    assert http.get("/healthcheck") is not None
    with pytest.raises(AuthenticationError):
        http.version()


@pytest.mark.parametrize("bad", ["", " lead", "two\nlines", "x\r\ny", "ключ"])
def test_malformed_key_refused_without_echo(bad):
    with pytest.raises(InvalidArgumentError, match="API key from api_key=") as ei:
        resolve_api_key(bad)
    assert bad.strip() == "" or bad.strip() not in str(ei.value)


def test_key_file_errors(tmp_path, no_env_key, monkeypatch):
    monkeypatch.setenv("LMCACHE_API_KEY_FILE", str(tmp_path / "absent"))
    with pytest.raises(InvalidArgumentError, match="cannot read the API key file"):
        resolve_api_key(None)
    two = tmp_path / "two"
    two.write_text("a\nb\n")
    monkeypatch.setenv("LMCACHE_API_KEY_FILE", str(two))
    with pytest.raises(InvalidArgumentError, match=r"exactly one non-empty line \(the key\), found 2"):
        resolve_api_key(None)
    with pytest.raises(TypeError, match="api_key must be a str"):
        resolve_api_key(b"bytes")  # type: ignore[arg-type]
