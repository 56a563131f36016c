"""Fixtures of the engine tests on top of the shared ones (tests/engine_fixtures.py).

The engine, the server and the oracle are session-scoped in tests/engine_fixtures.py
(shared with tests/sdk, each stopped right after the last test using it); here: the
engine's KV geometry and this SDK connected to its model.

Everything under tests/engine gets the ``engine`` marker and a long timeout (an engine
start takes ~20 s on a quiet 2-core box, minutes on a loaded one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import lmcache_kv_fast as lkf
from lmcache_kv_fast.layout import CpuEngineKV, KVLayout
from lmcache_kv_fast.testing import LMCacheServer
from testbed.engine import OfflineEngine

from .common import BLOCK, ENGINE_TEST_TIMEOUT


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stops_engine: stops the shared offline engine (runs right after the "
        "last other test using either engine, tests/engine_fixtures.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT))


@pytest.fixture(scope="package")
def cpu_kv(tiny_model: Path, offline_engine: OfflineEngine) -> CpuEngineKV:
    """The engine's KV geometry and in-block order (kernel as the engine reports it)."""
    lay = KVLayout.from_hf_config(tiny_model, block_size=BLOCK)
    return CpuEngineKV.from_token_layout(lay, offline_engine.isa[0])


@pytest.fixture(scope="package")
def sdk(engine_server: LMCacheServer, model_name: str, offline_engine: OfflineEngine
        ) -> Iterator[lkf.LMCacheKVCacheContext]:
    """This SDK on the engine's model the way a user connects: the model name, nothing else.

    It finds the CPU engine's geometry itself; retrieve/store move per-token K/V (``raw=True``:
    the engine's rows).
    """
    ctx = lkf.connect(engine_server.url, engine_server.http_url, model_name, timeout=60)
    try:
        yield ctx
    finally:
        ctx.close()
