"""Compatibility matrix: every real LMCache MP server 0.5.1 .. 0.5.7rc2 x {SHM, pickle} x
{ours -> ours, theirs -> ours, ours -> theirs}, "theirs" being that version's own SDK.
"pickle" is the plane without SHM (pickled tensors up to 0.5.6, 0.5.7's TensorEnvelope).

Each (version, plane) gets one real server of that version (from ``.venv-compat/<ver>``,
``scripts/compat-venvs.sh``; 0.5.6 also from the main venv) and one child process running
that version's own lmcache client, which registers the vLLM-like HND CPU layout and stores /
retrieves with that version's ``lmcache.sdk.kvcache``.

0.5.6 and 0.5.7rc2 (``DEFAULT_VERSIONS``) run in the default suite, over ZMQ and, as the
``-grpc`` rows, over gRPC (``--transport grpc``; their own SDK uses the ``grpc://`` URL
too); the older versions are marked ``compat`` (``make test-compat``). A version whose
venv is missing is skipped with the command that creates it (``scripts/test.sh`` makes
0.5.7rc2's).
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast import batch, edits
from lmcache_kv_fast.protocol.ops import Op, generation_for
from lmcache_kv_fast.testing import LMCacheServer
from lmcache_kv_fast.transport import open_control
from testbed.compat import (
    ALL_VERSIONS,
    DEFAULT_VERSIONS,
    TheirSDK,
    compat_server,
    missing_venv_hint,
    venv_python,
)

C = 256  # --chunk-size of every server here
L, NH, HS = 4, 8, 64  # registered geometry: D = NH * HS = 512, bf16
D = NH * HS
DTYPE = torch.bfloat16
_NAMES = itertools.count()


def _params() -> Iterator[object]:
    for version in ALL_VERSIONS:
        marks = () if version in DEFAULT_VERSIONS else (pytest.mark.compat,)
        for plane in ("shm", "pickle"):
            yield pytest.param((version, plane, "zmq"), id=f"{version}-{plane}", marks=marks)
    # gRPC (`--transport grpc`) on the servers that have it and the default suite's versions
    for version in DEFAULT_VERSIONS:
        for plane in ("shm", "pickle"):
            yield pytest.param((version, plane, "grpc"), id=f"{version}-{plane}-grpc")


@dataclass
class Setup:
    """One real server of ``version`` and that version's own client."""

    version: str
    plane: str
    server: LMCacheServer
    theirs: TheirSDK
    transport: str = "zmq"

    def model(self) -> str:
        """A fresh model registered (HND, CPU) with that version's own client."""
        name = f"compat-{self.version}-{self.plane}-{os.getpid()}-{next(_NAMES)}"
        self.theirs.register_hnd(name, num_layers=L, num_kv_heads=NH, head_size=HS,
                                 dtype="bfloat16", block_size=16)
        return name

    def ours(self, model: str) -> lmc_sdk.LMCacheKVCacheContext:
        return lmc_sdk.connect(self.server.url, self.server.http_url, model, timeout=30)


def _segments(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


@pytest.fixture(scope="module", params=list(_params()))
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    version, plane, transport = request.param
    if venv_python(version) is None:
        print(f"\n[compat] {missing_venv_hint(version)}")
        pytest.skip(missing_venv_hint(version))
    server = compat_server(version, shm=plane == "shm", l1_size_gb=0.5, transport=transport)
    workdir = Path(tempfile.mkdtemp(prefix=f"lmckvf-compat-{version}-{plane}-"))
    theirs: TheirSDK | None = None
    try:
        server.start()  # picks the ports
        theirs = TheirSDK(version, server.url, server.http_url, workdir).start()
        yield Setup(version, plane, server, theirs, transport)
    finally:
        if theirs is not None:
            theirs.stop()
        pool = server.pool_segment
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    # every started server stopped, every segment removed
    assert server.proc is None
    assert not pool or not (Path("/dev/shm") / pool).exists(), pool
    assert not _segments(f"lmckvf_kv_{os.getpid()}_")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 2**31) for _ in range(n)]


def _kv(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, L, t, D), generator=g, dtype=torch.float32).to(DTYPE)


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-exact equality (bf16 compared as bytes)."""
    return a is not None and a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_no_leftovers(s: Setup) -> None:
    st = s.server.settled_status()
    assert st["active_sessions"] == 0, st["active_sessions"]
    assert st["active_prefetch_jobs"] == 0, st["active_prefetch_jobs"]
    l1 = st["storage_manager"]["l1_manager"]
    assert l1["read_locked_count"] == 0 and l1["write_locked_count"] == 0, l1


def test_ours_to_ours(setup: Setup) -> None:
    s = setup
    model = s.model()
    with s.ours(model) as ctx:
        # handshake: the right table, chosen once from /version
        assert ctx.generation is generation_for(s.version)
        assert ctx.server_version.startswith(s.version)
        assert ctx.transport == s.plane
        assert ctx.chunk_size == C
        # bit-exact bf16
        toks = _tokens(3 * C, seed=1)
        kv = _kv(3 * C, seed=2)
        assert ctx.store(kv, toks) is True
        assert _same(ctx.retrieve(toks), kv)
        # partial hit: divergence inside chunk 2
        other = list(toks)
        other[2 * C + 5] = (other[2 * C + 5] + 1) % 2**31
        assert _same(ctx.retrieve(other), kv[:, :, : 2 * C])
        assert ctx.lookup(other) == 2 * C and ctx.lookup(toks) == 3 * C
        # unaligned length: truncated to whole chunks
        toks_u = _tokens(2 * C + 100, seed=3)
        kv_u = _kv(2 * C + 100, seed=4)
        res = ctx.store_ex(kv_u, toks_u)
        assert res.ok and res.chunks_total == 2 and res.tokens_stored == 2 * C
        assert _same(ctx.retrieve(toks_u), kv_u[:, :, : 2 * C].contiguous())
        # a second store of the same data: already cached, not an error
        again = ctx.store_ex(kv_u, toks_u)
        assert again.ok and again.chunks_already_cached == 2 and again.chunks_written == 0
        # salt isolation
        toks_s = _tokens(C, seed=5)
        kv_a, kv_b = _kv(C, seed=6), _kv(C, seed=7)
        assert ctx.store(kv_a, toks_s, cache_salt="tenant-a")
        assert ctx.retrieve(toks_s) is None
        assert ctx.retrieve(toks_s, cache_salt="tenant-b") is None
        assert ctx.store(kv_b, toks_s, cache_salt="tenant-b")
        assert _same(ctx.retrieve(toks_s, cache_salt="tenant-a"), kv_a)
        assert _same(ctx.retrieve(toks_s, cache_salt="tenant-b"), kv_b)
        # unknown tokens miss
        assert ctx.retrieve(_tokens(2 * C, seed=8)) is None
        # a library edit: slot to slot on the SHM plane, on tensors on the inline one
        rep = batch.rewrite(ctx, [toks], edits.drop_every(10), progress=False)
        assert rep.ok == 1 and rep.path == ("fused" if s.plane == "shm" else "tensor"), \
            rep.summary()
        keep = [i for i in range(3 * C) if i % 10 != 9][: 2 * C]
        assert _same(ctx.retrieve([toks[i] for i in keep]), kv[:, :, keep].contiguous())
        _assert_no_leftovers(s)


def test_theirs_to_ours(setup: Setup) -> None:
    s = setup
    model = s.model()
    h = s.theirs.connect(model)
    try:
        with s.ours(model) as ctx:
            toks = _tokens(3 * C, seed=11)
            kv = _kv(3 * C, seed=12)
            assert s.theirs.store(h, kv, toks) is True
            assert _same(ctx.retrieve(toks), kv)
            # their truncation of an unaligned tensor agrees with ours
            toks_u = _tokens(C + 33, seed=13)
            kv_u = _kv(C + 33, seed=14)
            assert s.theirs.store(h, kv_u, toks_u) is True
            assert _same(ctx.retrieve(toks_u), kv_u[:, :, :C].contiguous())
            # salts agree
            toks_s = _tokens(C, seed=15)
            kv_s = _kv(C, seed=16)
            assert s.theirs.store(h, kv_s, toks_s, cache_salt="s1") is True
            assert ctx.retrieve(toks_s) is None
            assert _same(ctx.retrieve(toks_s, cache_salt="s1"), kv_s)
    finally:
        s.theirs.close(h)


def test_ours_to_theirs(setup: Setup) -> None:
    s = setup
    model = s.model()
    h = s.theirs.connect(model)
    try:
        with s.ours(model) as ctx:
            toks = _tokens(2 * C + 17, seed=21)
            kv = _kv(2 * C + 17, seed=22)
            assert ctx.store(kv, toks) is True
            assert _same(s.theirs.retrieve(h, toks), kv[:, :, : 2 * C].contiguous())
            # a partial hit seen by their SDK
            other = list(toks[: 2 * C])
            other[C + 1] = (other[C + 1] + 1) % 2**31
            assert _same(s.theirs.retrieve(h, other), kv[:, :, :C].contiguous())
            # salts agree
            toks_s = _tokens(C, seed=23)
            kv_s = _kv(C, seed=24)
            assert ctx.store(kv_s, toks_s, cache_salt="s2") is True
            assert s.theirs.retrieve(h, toks_s) is None
            assert _same(s.theirs.retrieve(h, toks_s, cache_salt="s2"), kv_s)
    finally:
        s.theirs.close(h)


def test_clear_with_the_generations_arity(setup: Setup) -> None:
    # clear() takes no payload up to 0.5.5 and a `force` bool in 0.5.6; the wrong arity is
    # silently dropped by the server (no reply), so a reply proves the table right.
    s = setup
    model = s.model()
    with s.ours(model) as ctx:
        toks = _tokens(2 * C, seed=31)
        assert ctx.store(_kv(2 * C, seed=32), toks)
        assert ctx.lookup(toks) == 2 * C
        gen = ctx.generation
        client = open_control(s.server.url, gen, 10.0)
        try:
            payloads = [False] if gen.clear_takes_force else []
            assert client.call(Op.CLEAR, payloads) is None  # a 2-frame reply
            assert client.call(Op.NOOP, []) == "OK"  # the request loop is alive
        finally:
            client.close()
        assert ctx.lookup(toks) == 0
