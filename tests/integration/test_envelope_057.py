"""The 0.5.7 inline plane (msgpack TensorEnvelope) against a real LMCache 0.5.7rc2 server
without SHM, against 0.5.7rc2's own wire code and, where it runs, its own SDK."""

from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

import lmcache_kv_fast.kvcache as lmc_sdk
from lmcache_kv_fast.dataplane.envelope import EnvelopeFrameBuilder, locate_tensors
from lmcache_kv_fast.layout import KVLayout
from lmcache_kv_fast.protocol.ops import GEN_057
from lmcache_kv_fast.testing import LMCacheServer
from testbed.compat import TheirSDK, compat_server, missing_venv_hint, venv_python

VERSION = "0.5.7rc2"
C = 256
_names = iter(range(10**6))

pytestmark = pytest.mark.skipif(venv_python(VERSION) is None, reason=missing_venv_hint(VERSION))


@pytest.fixture(scope="module")
def server() -> Iterator[LMCacheServer]:
    """One real 0.5.7rc2 server without SHM (the inline plane)."""
    srv = compat_server(VERSION, shm=False, l1_size_gb=0.5)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
    assert srv.proc is None


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 2**31) for _ in range(n)]


def _kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Bit-exact equality (compared as bytes)."""
    return a is not None and a.shape == b.shape and a.dtype == b.dtype and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _connect(server: LMCacheServer, layout: KVLayout, **kw) -> lmc_sdk.LMCacheKVCacheContext:
    return lmc_sdk.connect(server.url, server.http_url, f"env057-{next(_names)}", timeout=20,
                           layout=layout, **kw)


def _no_leftovers(server: LMCacheServer) -> None:
    st = server.settled_status()
    assert st["active_sessions"] == 0, st["active_sessions"]
    l1 = st["storage_manager"]["l1_manager"]
    assert l1["read_locked_count"] == 0 and l1["write_locked_count"] == 0, l1


def test_handshake_picks_the_envelope(server):
    with _connect(server, KVLayout(2, 2, 64, "bfloat16")) as ctx:
        assert ctx.generation is GEN_057 and GEN_057.inline_envelope
        assert ctx.server_version.startswith(VERSION)
        assert ctx.transport == "pickle"  # the non-SHM plane keeps its public name
        assert ctx.chunk_size == C


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_roundtrip_bit_exact(server, dtype):
    lay = KVLayout(3, 4, 64, dtype)
    toks = _tokens(3 * C, seed=1)
    kv = _kv((2, 3, 3 * C, 256), dtype, seed=2)
    with _connect(server, lay) as ctx:
        assert ctx.store(kv, toks) is True
        assert _same(ctx.retrieve(toks), kv)
        assert ctx.lookup(toks) == 3 * C
    _no_leftovers(server)


def test_single_plane_fp32_and_tensor_parallel_bf16(server):
    mla = KVLayout(3, 1, 576, torch.float32, mla=True)
    toks = _tokens(2 * C, seed=3)
    kv = _kv((3, 2 * C, 576), torch.float32, seed=4)
    with _connect(server, mla) as ctx:
        assert ctx.store(kv, toks) is True
        assert _same(ctx.retrieve(toks), kv)
    tp = KVLayout(2, 4, 64, torch.bfloat16)
    kv2 = _kv((2, 2, 2 * C, 256), torch.bfloat16, seed=5)
    with _connect(server, tp, world_size=2) as ctx:  # one envelope per shard
        assert ctx.store(kv2, toks) is True
        assert _same(ctx.retrieve(toks), kv2)
    _no_leftovers(server)


def test_store_ex_partial_hits_and_out(server):
    lay = KVLayout(2, 4, 64, torch.bfloat16)
    toks = _tokens(4 * C + 50, seed=6)
    kv = _kv((2, 2, 4 * C + 50, 256), torch.bfloat16, seed=7)
    with _connect(server, lay) as ctx:
        # a cached first chunk: the envelope carries only chunks 1..3 (key start = C)
        assert ctx.store(kv[:, :, :C].contiguous(), toks[:C]) is True
        res = ctx.store_ex(kv, toks)
        assert res.ok and res.chunks_total == 4 and res.tokens_stored == 4 * C
        assert res.chunks_written == 3 and res.chunks_already_cached == 1
        again = ctx.store_ex(kv, toks)
        assert again.ok and again.chunks_written == 0 and again.chunks_already_cached == 4
        # a divergence inside chunk 2: a two-chunk hit
        other = list(toks)
        other[2 * C + 7] = (other[2 * C + 7] + 1) % 2**31
        assert _same(ctx.retrieve(other), kv[:, :, :2 * C].contiguous())
        assert ctx.lookup(other) == 2 * C
        # into the caller's tensor
        out = torch.full((2, 2, 5 * C, 256), 7.0, dtype=torch.bfloat16)
        got = ctx.retrieve(toks, out=out)
        assert got is not None and got.data_ptr() == out.data_ptr()
        assert _same(got, kv[:, :, :4 * C].contiguous())
        assert bool((out[:, :, 4 * C:] == 7.0).all())
        assert ctx.retrieve(_tokens(2 * C, seed=8)) is None
    _no_leftovers(server)


# ----------------------------------------------------------------- 0.5.7rc2's own code
_THEIR_WIRE = textwrap.dedent("""
    import sys, msgspec, torch
    from lmcache.v1.multiprocess.transfer_context.tensor_wire import decode_tensors, encode_tensors
    d = sys.argv[1]
    chunks = torch.load(d + "/chunks.pt", weights_only=True)
    frame = open(d + "/frame.bin", "rb").read()
    got = decode_tensors(msgspec.msgpack.decode(frame, type=bytes), expected_shape=chunks[0].shape,
                         expected_dtype=chunks[0].dtype, expected_count=len(chunks))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, chunks))
    open(d + "/theirs.bin", "wb").write(encode_tensors(chunks))
    print("ok", len(got))
""")


@pytest.mark.parametrize("shape, dtype", [((2, 3, C, 256), torch.bfloat16),
                                          ((3, C, 576), torch.float32),
                                          ((2, 2, 16, 64), torch.float16)])
def test_their_decoder_reads_our_frames_and_we_read_theirs(tmp_path, shape, dtype):
    """Our builder's frame through 0.5.7rc2's ``decode_tensors``; its ``encode_tensors``
    through our locator."""
    chunks = [_kv(shape, dtype, seed=s) for s in range(5)]
    b = EnvelopeFrameBuilder(shape, dtype)
    _backing, frame, offsets = b.build(len(chunks))
    flat = torch.frombuffer(frame, dtype=torch.uint8)
    for c, o in zip(chunks, offsets, strict=True):
        flat[o:o + b.nbytes].copy_(c.reshape(-1).view(torch.uint8))
    (tmp_path / "frame.bin").write_bytes(bytes(frame))
    torch.save(chunks, tmp_path / "chunks.pt")
    py = venv_python(VERSION)
    assert py is not None
    run = subprocess.run([py, "-c", _THEIR_WIRE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["ok", "5"], run.stderr[-2000:]
    theirs = (tmp_path / "theirs.bin").read_bytes()
    spans = locate_tensors(theirs, 5, shape, dtype, "t")
    assert [theirs[o:o + n] for o, n in spans] == \
        [c.reshape(-1).view(torch.uint8).numpy().tobytes() for c in chunks]
    assert msgspec.msgpack.decode(theirs)["version"] == 1


@pytest.fixture(scope="module")
def theirs(server: LMCacheServer) -> Iterator[TheirSDK]:
    workdir = Path(tempfile.mkdtemp(prefix="lmckvf-env057-"))
    sdk = TheirSDK(VERSION, server.url, server.http_url, workdir)
    try:
        sdk.start()
        yield sdk
    finally:
        sdk.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_interop_with_their_sdk(server, theirs):
    model = f"env057-theirs-{next(_names)}"
    theirs.register_hnd(model, num_layers=4, num_kv_heads=8, head_size=64, dtype="bfloat16",
                        block_size=16)
    h = theirs.connect(model)
    try:
        with lmc_sdk.connect(server.url, server.http_url, model, timeout=20) as ctx:
            assert ctx.transport == "pickle" and ctx.generation is GEN_057
            toks = _tokens(2 * C, seed=41)
            kv = _kv((2, 4, 2 * C, 512), torch.bfloat16, seed=42)
            assert theirs.store(h, kv, toks) is True
            assert _same(ctx.retrieve(toks), kv)
            toks2 = _tokens(3 * C + 9, seed=43)
            kv2 = _kv((2, 4, 3 * C + 9, 512), torch.bfloat16, seed=44)
            assert ctx.store(kv2, toks2) is True
            assert _same(theirs.retrieve(h, toks2), kv2[:, :, :3 * C].contiguous())
    finally:
        theirs.close(h)
