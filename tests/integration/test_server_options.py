"""``LMCacheServer``'s per-version launch options against real 0.5.6 and 0.5.7rc2 servers:
API keys (``--api-key-file``), server modules (the ``qstore`` query module), gRPC transport.

The 0.5.7rc2 tests need its venv (``scripts/compat-venvs.sh 0.5.7rc2``, made by
``scripts/test.sh``) and are skipped with that command when it is missing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lmcache_kv_fast.errors import KVCacheSDKError
from lmcache_kv_fast.protocol.ops import Op
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.testing.server import QSTORE_MODULE, zmq_noop
from lmcache_kv_fast.transport.http import HttpInfoClient
from lmcache_kv_fast.transport.zmq_client import ZmqClient
from testbed.compat import (
    MAIN_VERSION,
    TEST_SERVER_ENV,
    compat_server,
    missing_venv_hint,
    suite_server_kwargs,
    suite_server_version,
    venv_python,
)
from testbed.query_export import QUERY_SERVER_ARGS, query_server_kwargs

V057 = "0.5.7rc2"
needs_057 = pytest.mark.skipif(venv_python(V057) is None, reason=missing_venv_hint(V057))


def _experimental(srv: LMCacheServer) -> list[str]:
    client = ZmqClient(srv.url, srv.generation, 10.0)
    try:
        return list(client.call(Op.GET_EXPERIMENTAL, []))
    finally:
        client.close()


def test_command_lines_per_version():
    old = LMCacheServer(version="0.5.6")
    new = LMCacheServer(version=V057, python="/nonexistent/python",
                        server_modules=[QSTORE_MODULE], transport="grpc")
    assert "--enable" not in new.command() and "--enable" not in old.command()
    cmd = new.command()
    assert cmd[cmd.index("--transport") + 1] == "grpc"
    assert cmd[cmd.index("--server-module") + 1] == \
        '{"module_path": "lmcache.v1.multiprocess.plugin_modules.qstore"}'
    assert new.url.startswith("grpc://") and old.url.startswith("tcp://")
    # the query module: --enable up to 0.5.6, the qstore plugin from 0.5.7 on
    assert query_server_kwargs(None) == {"extra_args": list(QUERY_SERVER_ARGS)}
    assert query_server_kwargs("0.5.6") == {"extra_args": list(QUERY_SERVER_ARGS)}
    assert query_server_kwargs(V057) == {"server_modules": [QSTORE_MODULE]}
    with pytest.raises(ValueError, match="0.5.7"):
        LMCacheServer(api_key="k")  # 0.5.6 has no API keys
    with pytest.raises(ValueError, match="transport"):
        LMCacheServer(version=V057, transport="http")


def test_suite_server_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv(TEST_SERVER_ENV, raising=False)
    assert suite_server_version() == MAIN_VERSION and suite_server_kwargs() == {}
    py057 = venv_python(V057)
    if py057 is not None:
        monkeypatch.setenv(TEST_SERVER_ENV, V057)
        assert suite_server_kwargs() == {"python": py057, "version": V057}
    monkeypatch.setenv(TEST_SERVER_ENV, "0.5.4")
    monkeypatch.setenv("LMCACHE_COMPAT_VENVS", str(tmp_path))  # no venv there
    with pytest.raises(FileNotFoundError, match="compat-venvs.sh 0.5.4"):
        suite_server_kwargs()


@needs_057
def test_api_key_protects_http_and_the_helpers_send_it():
    with compat_server(V057, shm=True, l1_size_gb=0.25, api_key="test-key-1") as srv:
        key_file = srv.api_key_file
        assert key_file is not None and key_file.read_text().strip() == "test-key-1"
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        assert srv.status()["chunk_size"] == srv.chunk_size  # sends the key
        srv.clear()
        assert srv.http().version().startswith(V057)
        with pytest.raises(KVCacheSDKError, match="HTTP 401"):
            HttpInfoClient(srv.http_url, 5.0).status()
        with pytest.raises(KVCacheSDKError, match="HTTP 401"):
            HttpInfoClient(srv.http_url, 5.0, api_key="wrong").status()
        assert zmq_noop(srv.url, srv.generation)  # 0.5.7rc2: ZMQ has no authentication
    assert not key_file.exists()  # the temporary key file went with the server


@needs_057
def test_api_key_file_and_qstore_module(tmp_path: Path):
    path = tmp_path / "key.txt"
    path.write_text("file-key-2\n")
    with compat_server(V057, shm=True, l1_size_gb=0.25, api_key_file=path,
                       **query_server_kwargs(V057)) as srv:
        assert srv.api_key == "file-key-2"
        assert "non_cuda_context_meta" in srv.status()
        assert _experimental(srv) == ["transfer_query"]
    assert path.exists()  # the caller's file is left alone
    with compat_server(V057, shm=True, l1_size_gb=0.25) as srv:
        assert _experimental(srv) == []


@needs_057
def test_grpc_transport():
    with compat_server(V057, shm=False, l1_size_gb=0.25, transport="grpc") as srv:
        assert srv.url == f"grpc://127.0.0.1:{srv.port}"
        assert srv.http().config()["mp"]["transport"] == "grpc"
        # the server runs gRPC instead of ZMQ: a ZMQ noop gets no reply
        assert not zmq_noop(f"tcp://127.0.0.1:{srv.port}", srv.generation, timeout=1.0)
