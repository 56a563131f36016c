"""Shared fixtures: real LMCache servers (SHM and pickle planes) and registered models.

``LMCACHE_KV_FAST_TEST_SERVER=<version>`` (e.g. ``0.5.7rc2``) makes the server fixtures and
:func:`new_server` start that version from its compat venv (``scripts/compat-venvs.sh``,
``LMCACHE_COMPAT_VENVS``) instead of the main venv's 0.5.6 (docs/testing.md).

The real-engine fixtures (vLLM CPU engine, its server, the oracle) live in
tests/engine_fixtures.py, session-scoped and stopped right after their last test.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from engine_fixtures import (  # noqa: F401 - fixtures shared by tests/engine and tests/sdk
    engine_log_sections,
    engine_server,
    mark_engine_items,
    model_name,
    offline_engine,
    openai_engine,
    oracle,
    release_unused,
    tiny_model,
)

from lmcache_kv_fast.protocol.ops import parse_version
from lmcache_kv_fast.testing import LMCacheServer, register_vllm_layout
from testbed.compat import suite_server_kwargs, suite_server_version

_MODEL_COUNTER = itertools.count()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"pytest got signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (CI timeout, ``kill``) stops pytest like Ctrl-C: every fixture's teardown
    still runs, so no server, engine, Ray cluster or SHM segment outlives the run."""
    signal.signal(signal.SIGTERM, _terminate)


#: Fixtures that run transformers in the engine venv (a child per module); their tests get the
#: ``oracle`` marker, which ``make test-fast`` skips.
ORACLE_FIXTURES = {"oracle", "oracle_model", "model_run"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the oracle's tests; keep each shared heavy resource on one xdist worker.

    Under ``pytest -n 2 --dist loadgroup`` (scripts/test.sh) the tests of the shared vLLM
    engines run on one worker, in their order (one engine at a time on a 2-core box, the
    engine stopper after its users), and so do those of the local Ray cluster. First
    (``tryfirst``): xdist's own hook turns the ``xdist_group`` marks into node ids, so a
    mark added after it is ignored (:func:`xdist_groups_hold` checks).
    """
    mark_engine_items(items)
    for item in items:
        if ORACLE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.oracle)
        if item.get_closest_marker("engine") is not None or "engine" in item.path.parent.name:
            item.add_marker(pytest.mark.xdist_group("engine"))
        elif item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session", autouse=True)
def xdist_groups_hold(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup``, every grouped test carries its group in its node id.

    pytest 9.2 keeps node ids where xdist 3.8 cannot append the group (pytest-xdist#1386):
    the groups are then silently ignored and two workers start engines side by side.
    """
    if not getattr(request.config.option, "loadgroup", False):  # an xdist worker's option
        return
    for item in request.session.items:
        for mark in item.iter_markers("xdist_group"):
            if not item.nodeid.endswith("@" + mark.args[0]):
                raise pytest.UsageError(
                    f"{item.nodeid}: its xdist_group {mark.args[0]!r} is not in its node id, "
                    "so --dist loadgroup ignores it (pytest-xdist#1386: use pytest < 9.2)")


@pytest.fixture(scope="session")
def oracle_model() -> Path:
    """The tiny random-weight Llama for the unit tier's transformers oracle, else a skip."""
    from testbed.engine_proc import EngineChildError, engine_python
    from testbed.tiny_model import ensure_tiny_model

    try:
        engine_python()
        return ensure_tiny_model()
    except EngineChildError as exc:
        pytest.skip(f"tiny model unavailable: {exc}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    release_unused(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for title, text in engine_log_sections(item):
            report.sections.append((title, text))


#: The server version the suite runs against (``LMCACHE_KV_FAST_TEST_SERVER``, default 0.5.6).
SERVER_VERSION = suite_server_version()
#: Whether that is 0.5.7 or later (query store plugin, API keys, ``token_bytes`` keys).
SERVER_057 = (parse_version(SERVER_VERSION) or (0,)) >= (0, 5, 7)


def skip_on_057(why: str) -> pytest.MarkDecorator:
    """Skip a test whose subject does not exist on a 0.5.7+ test server; ``why`` names the
    server difference."""
    return pytest.mark.skipif(SERVER_057, reason=f"LMCache {SERVER_VERSION} server: {why}")


def new_server(shm: bool = True, **kw: Any) -> LMCacheServer:
    """An unstarted real server of the suite's version (``LMCacheServer(shm=shm, **kw)``)."""
    return LMCacheServer(shm=shm, **{**suite_server_kwargs(), **kw})


def start_server(shm: bool, **kw: Any) -> Iterator[LMCacheServer]:
    """Body of a server fixture: ``yield from start_server(...)`` starts a real server of the
    suite's version (:func:`new_server`), yields it and stops it, also after a failed start."""
    srv = new_server(shm, **kw)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server_shm() -> Iterator[LMCacheServer]:
    """A real server (0.5.6 unless ``LMCACHE_KV_FAST_TEST_SERVER``) with the SHM data plane."""
    yield from start_server(True, l1_size_gb=1.0)


@pytest.fixture(scope="session")
def server_pickle() -> Iterator[LMCacheServer]:
    """A real server with the inline data plane (no SHM; pickle up to 0.5.6)."""
    yield from start_server(False, l1_size_gb=0.5)


@pytest.fixture(params=["shm", "pickle"])
def server(request: pytest.FixtureRequest) -> LMCacheServer:
    """Each test runs against both data planes."""
    return request.getfixturevalue(f"server_{request.param}")


@dataclass
class Model:
    """A model registered the way vLLM registers it."""

    server: LMCacheServer
    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    mla: bool = False
    world_size: int = 1

    @property
    def hidden(self) -> int:
        return self.head_size if self.mla else self.num_kv_heads * self.head_size

    def kv(self, tokens: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        shape = (self.num_layers, tokens, self.hidden) if self.mla else \
            (2, self.num_layers, tokens, self.hidden)
        if self.dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=torch.float32).to(self.dtype)
        return torch.randint(-100, 100, shape, generator=g).to(self.dtype)


def unique_model_name(prefix: str = "m") -> str:
    return f"{prefix}-{os.getpid()}-{next(_MODEL_COUNTER)}"


def make_model(server: LMCacheServer, *, num_layers: int = 4, num_kv_heads: int = 8,
               head_size: int = 128, dtype: torch.dtype = torch.bfloat16, mla: bool = False,
               layout: str = "NHD", world_size: int = 1, name: str | None = None) -> Model:
    name = name or unique_model_name()
    register_vllm_layout(
        server.url, name, num_layers=num_layers, num_kv_heads=1 if mla else num_kv_heads,
        head_size=head_size, dtype=str(dtype).removeprefix("torch."),
        layout="MLA" if mla else layout, world_size=world_size,
    )
    return Model(server, name, num_layers, 1 if mla else num_kv_heads, head_size, dtype, mla,
                 world_size)


@pytest.fixture
def model(server: LMCacheServer) -> Model:
    """A fresh bf16 two-plane model (4 layers, D=1024) on the parametrized server."""
    return make_model(server)


def rand_tokens(n: int, seed: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 2**31) for _ in range(n)]


def create_shm_segment(size: int, tag: str = "test") -> str:
    """Create ``/dev/shm/lmckv-<tag>-<pid>-<random>`` of ``size`` bytes (mode 0600).

    Returns the bare segment name; the caller unlinks it.
    """
    name = f"lmckv-{tag}-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return name


@pytest.fixture
def shm_segments(request: pytest.FixtureRequest) -> Iterator[Callable[[int], str]]:
    """``make(size) -> name``: fresh /dev/shm segments, every one unlinked afterwards."""
    created: list[str] = []
    tag = request.module.__name__.rpartition(".")[2].removeprefix("test_")

    def make(size: int) -> str:
        created.append(create_shm_segment(size, tag))
        return created[-1]

    try:
        yield make
    finally:
        for name in created:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def run_threads(worker: Callable[[int], None], n: int, timeout: float = 120.0) -> list[BaseException]:
    """Run ``worker(i)`` for ``i in range(n)`` on threads; return what they raised.

    Fails the test if a thread is still running after ``timeout`` seconds.
    """
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            worker(i)
        except BaseException as err:  # reported to the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,), name=f"test-worker-{i}") for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), f"a worker ran over {timeout}s"
    return errors


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wait_all_zero(read: Callable[[], dict[str, int]], timeout: float,
                  step: float = 0.1) -> dict[str, int]:
    """Poll ``read()`` until every value is zero or ``timeout`` passed; return the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        left = read()
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(step)


def assert_script_refuses(script: str, refused: int, timeout: float) -> None:
    """Run ``script`` in a fresh interpreter: it must exit 0 (no crash) and print
    ``REFUSED <refused>`` (how many of its hostile calls raised)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"crashed ({out.returncode}): {out.stderr[-2000:]}"
    assert f"REFUSED {refused}" in out.stdout, out.stdout + out.stderr[-2000:]
