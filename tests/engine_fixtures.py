"""Real-engine fixtures shared by tests/engine and tests/sdk (imported by tests/conftest.py).

A vLLM CPU engine on the tiny Llama (offline ``vllm.LLM`` and the OpenAI-compatible
server), the real LMCache server they write into, and the transformers oracle. They are
session-scoped so both directories share one of each, and each is stopped right after
the last collected test that uses it (:func:`release_unused`, called from
tests/conftest.py after every test), not at the end of the session: an engine holds
~2 GB and its threads while the rest of the suite runs.

Tests using any of them get the ``engine`` marker and a long timeout (an engine start
takes ~20 s on a quiet 2-core box, minutes on a loaded one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.testing.logtail import log_errors, log_tail
from testbed.engine import OfflineEngine, OpenAIEngine, engine_lmcache_server
from testbed.oracle import TransformersOracle
from testbed.tiny_model import ensure_tiny_model

BLOCK = 128  # vLLM block size of every engine here
CHUNK = 256  # LMCache chunk size of the engine server
ENGINE_TEST_TIMEOUT = 1200
#: Fixtures that start a process; a test using one (directly or not) is an engine test.
ENGINE_FIXTURES = ("engine_server", "offline_engine", "openai_engine", "oracle")

#: Log lines left out of a failure's log tail (one per request).
_NOISE = ("Engine KV Format:", '"POST /v1/completions HTTP/1.1" 200', '"GET /metrics HTTP/1.1" 200')

_live: dict[str, Any] = {}  # fixture name -> started object with stop()
_items: list[pytest.Item] = []


def mark_engine_items(items: list[pytest.Item]) -> None:
    """Mark every test that uses an engine fixture; order the engine stoppers; remember the
    run order.

    A test marked ``stops_engine`` stops the shared offline engine and then expects no
    engine registered on the engine server (it unregisters what is left), so it runs
    right after the last other test that uses either engine, wherever that test lives
    (tests/sdk uses both after tests/engine does); the OpenAI engine is stopped by then
    (:func:`release_unused`).
    """
    for item in items:
        if set(ENGINE_FIXTURES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT))
    stoppers = [it for it in items if it.get_closest_marker("stops_engine") is not None]
    if stoppers:
        rest = [it for it in items if it.get_closest_marker("stops_engine") is None]
        users = [i for i, it in enumerate(rest)
                 if {"offline_engine", "openai_engine"} & set(getattr(it, "fixturenames", ()))]
        at = users[-1] + 1 if users else len(rest)
        items[:] = [*rest[:at], *stoppers, *rest[at:]]
    _items[:] = items


def release_unused(item: pytest.Item) -> None:
    """Stop the shared processes no test after ``item`` uses."""
    if not _live:
        return
    try:
        pos = _items.index(item)
    except ValueError:
        return
    later: set[str] = set()
    for it in _items[pos + 1:]:
        later.update(getattr(it, "fixturenames", ()))
    for name in ("oracle", "openai_engine", "offline_engine", "engine_server"):
        if name in _live and name not in later:
            _live.pop(name).stop()


def engine_log_sections(item: pytest.Item) -> list[tuple[str, str]]:
    """The tails of the logs of the shared engines ``item`` uses (added to its failure
    report: an engine that died mid-test says why only there)."""
    out = []
    for name in ("openai_engine", "offline_engine"):
        obj = _live.get(name)
        if obj is None or name not in getattr(item, "fixturenames", ()):
            continue
        path = getattr(obj, "log_path", None) or getattr(getattr(obj, "_child", None),
                                                         "log_path", None)
        errors = log_errors(path)
        if errors:  # first: a dead engine's traceback is often far from the log's end
            out.append((f"{name} log: error reports", errors))
        out.append((f"{name} log (last 80 lines, without access and KV-format lines)",
                    log_tail(path, 80, drop=_NOISE)))
    return out


def _hold(name: str, obj: Any) -> Iterator[Any]:
    _live[name] = obj
    try:
        obj.start()
        yield obj
    finally:
        _live.pop(name, None)
        obj.stop()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random-weight Llama directory (written once into .cache/engine)."""
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def model_name(tiny_model: Path) -> str:
    """The name vLLM registers the model by (its path)."""
    return str(tiny_model)


@pytest.fixture(scope="session")
def engine_server() -> Iterator[LMCacheServer]:
    """The real LMCache server the engines and SDKs share (SHM, chunk 256)."""
    yield from _hold("engine_server", engine_lmcache_server(chunk_size=CHUNK, l1_size_gb=0.5))


@pytest.fixture(scope="session")
def offline_engine(tiny_model: Path, engine_server: LMCacheServer) -> Iterator[OfflineEngine]:
    """``vllm.LLM`` with LMCacheMPConnector against ``engine_server``."""
    yield from _hold("offline_engine", OfflineEngine(tiny_model, engine_server.port,
                                                     block_size=BLOCK))


@pytest.fixture(scope="session")
def openai_engine(tiny_model: Path, engine_server: LMCacheServer) -> Iterator[OpenAIEngine]:
    """vLLM's OpenAI-compatible server with LMCacheMPConnector against ``engine_server``."""
    yield from _hold("openai_engine", OpenAIEngine(tiny_model, engine_server.port,
                                                   block_size=BLOCK))


@pytest.fixture(scope="session")
def oracle(tiny_model: Path) -> Iterator[TransformersOracle]:
    """transformers on the same weights (float32)."""
    yield from _hold("oracle", TransformersOracle(tiny_model))
