"""The native strided (permutation) copy: equal to torch's copy_ for random views, and every
out-of-range, overlapping or malformed request refused before a byte moves."""

from __future__ import annotations

import random

import pytest
import torch

from lmcache_kv_fast.copy.select import backend
from lmcache_kv_fast.copy.strided import copy_view

native = pytest.importorskip("lmcache_kv_fast._native")
pytestmark = pytest.mark.skipif(backend().NAME != "native", reason="native backend only")

DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _rand(shape, dtype, g):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("seed", range(40))
def test_random_permutations_equal_torch(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    nd = rng.randint(1, 6)
    shape = [rng.choice([1, 2, 3, 8, 16, 32, 48, 64]) for _ in range(nd)]
    src_base = _rand([s + rng.randint(0, 2) for s in shape], dtype, g)
    src = src_base[tuple(slice(0, s) for s in shape)]  # a slice: strided, offset
    perm = list(range(nd))
    rng.shuffle(perm)
    dst_base = torch.zeros([shape[p] for p in perm], dtype=dtype)
    dst = dst_base.permute(*[perm.index(i) for i in range(nd)])  # same shape as src
    if rng.random() < 0.5:
        src = src.permute(*perm).contiguous().permute(*[perm.index(i) for i in range(nd)])
    want = torch.zeros_like(dst_base)
    want.permute(*[perm.index(i) for i in range(nd)]).copy_(src)
    copy_view(dst, src)
    assert torch.equal(dst_base, want)


@pytest.mark.parametrize("kernel", ["vec", "amx"])
def test_engine_layouts_equal_torch(kernel, monkeypatch):
    """CPU engine planes (transposes with power-of-two pitches), both ways, native vs torch."""
    import lmcache_kv_fast.copy.strided as strided
    from lmcache_kv_fast.layout.cpu_engine import CpuEngineKV

    for dtype in (torch.bfloat16, torch.float32) if kernel == "vec" else (torch.bfloat16,):
        spec = CpuEngineKV(3, 4, 128, dtype, 128, kernel)
        kv = torch.randn(2, 3, 512, 512).to(dtype)
        raw = spec.to_raw(kv)
        back = spec.to_tokens(raw)
        with monkeypatch.context() as m:
            m.setattr(strided, "copy_view", lambda d, s: d.copy_(s))
            assert torch.equal(spec.to_raw(kv), raw)
            assert torch.equal(spec.to_tokens(raw), back)
        assert torch.equal(back, kv)


@pytest.mark.parametrize("rows,cols,off,pitch", [
    (32, 32, 0, 1024), (64, 96, 0, 1024), (96, 64, 1, 1024), (128, 32, 7, 1024),
    (32, 128, 3, 1024),
    # >= 4 MiB: streaming stores where the destination lines are 32-byte aligned
    (1536, 1536, 0, 2048), (1536, 1536, 3, 2048), (2048, 1056, 0, 2056),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int16])
def test_two_byte_transposes_equal_torch(rows, cols, off, pitch, dtype):
    """Whole 32 x 32 tiles of 2-byte elements (the AVX2 staged tile where the CPU has AVX2),
    at line-aligned and odd element offsets, with power-of-two pitches on both sides; the
    bytes around the destination view stay untouched."""
    g = torch.Generator().manual_seed(rows * cols + off)
    src_base = torch.randint(-2**15, 2**15 - 1, (rows * 2048 + off + cols,), generator=g,
                             dtype=torch.int16).view(dtype)
    src = src_base[off:off + rows * 2048].view(rows, 2048)[:, :cols]  # rows 4 KiB apart
    dst_base = torch.zeros(cols * pitch + off, dtype=dtype)
    dst = dst_base[off:].view(cols, pitch)[:, :rows].t()  # columns `pitch` elements apart
    copy_view(dst, src)
    assert torch.equal(dst.contiguous().view(torch.int16), src.contiguous().view(torch.int16))
    untouched = torch.ones(cols * pitch + off, dtype=torch.bool)
    untouched[off:].view(cols, pitch)[:, :rows] = False
    assert not bool(dst_base.view(torch.int16)[untouched].any())


@pytest.mark.parametrize("row_bytes,pitch_bytes,off_bytes", [
    (256, 2048, 0),    # a CPU engine's V plane: streaming stores
    (256, 2048, 2),    # destination rows off 32-byte alignment: memcpy
    (96, 160, 0),      # rows sharing destination lines, 32-byte aligned
    (64, 96, 0),       # the shortest streamed row; a pitch of 96 B leaves lines half written
    (48, 64, 0),       # not whole 32-byte units: memcpy
    (80 << 10, 96 << 10, 0),  # rows above 64 KiB: memcpy
])
@pytest.mark.parametrize("to_rows", [False, True])
def test_row_copies_at_and_above_4_mib_equal_torch(row_bytes, pitch_bytes, off_bytes, to_rows):
    """Row copies of 4 MiB or more (streaming stores where rows are whole 32-byte units on
    32-byte-aligned destination lines), rows scattered to or gathered from a pitch; the
    bytes between the destination's rows stay untouched."""
    rows = max(2, (5 << 20) // row_bytes)
    g = torch.Generator().manual_seed(row_bytes + pitch_bytes + off_bytes + to_rows)
    n, p, o = row_bytes // 2, pitch_bytes // 2, off_bytes // 2
    packed = torch.randint(-2**15, 2**15 - 1, (rows * n,), generator=g,
                           dtype=torch.int16).view(rows, n)
    spread_base = torch.zeros(rows * p + o + n, dtype=torch.int16)
    spread = spread_base[o:o + rows * p].view(rows, p)[:, :n]
    if to_rows:  # pitched rows -> packed rows (the destination contiguous)
        spread.copy_(packed)
        dst_base = torch.zeros(rows * n + o, dtype=torch.int16)
        dst = dst_base[o:].view(rows, n)
        copy_view(dst, spread)
        assert torch.equal(dst, packed)
        assert not bool(dst_base[:o].any())
    else:  # packed rows -> pitched rows
        copy_view(spread, packed)
        assert torch.equal(spread, packed)
        untouched = torch.ones_like(spread_base, dtype=torch.bool)
        untouched[o:o + rows * p].view(rows, p)[:, :n] = False
        assert not bool(spread_base[untouched].any())


def _call(dst, src, *, sizes, dstr, sstr, doff=0, soff=0, dn=None, sn=None, isz=None):
    dn = dst.numel() * dst.element_size() if dn is None else dn
    sn = src.numel() * src.element_size() if sn is None else sn
    native.strided_copy(dst.data_ptr(), dn, doff, src.data_ptr(), sn, soff,
                        dst.element_size() if isz is None else isz, sizes, dstr, sstr)


def test_refusals():
    a = torch.zeros(64, dtype=torch.float32)
    b = torch.arange(64, dtype=torch.float32)
    _call(a, b, sizes=[8, 8], dstr=[1, 8], sstr=[8, 1])  # a transpose: fine
    assert torch.equal(a.view(8, 8), b.view(8, 8).t())
    with pytest.raises(ValueError, match="destination view reaches"):
        _call(a, b, sizes=[8, 9], dstr=[8, 1], sstr=[1, 1])
    with pytest.raises(ValueError, match="source view reaches"):
        _call(a, b, sizes=[8, 8], dstr=[8, 1], sstr=[8, 1], soff=1)
    with pytest.raises(ValueError, match="destination view reaches"):
        _call(a, b, sizes=[4], dstr=[1], sstr=[1], dn=12)  # buffer smaller than the view
    with pytest.raises(ValueError, match="overlaps the source"):
        _call(a, a, sizes=[4], dstr=[1], sstr=[1])
    with pytest.raises(ValueError, match="overlaps itself"):
        _call(a, b, sizes=[4, 4], dstr=[1, 2], sstr=[4, 1])
    with pytest.raises(ValueError, match="negative"):
        _call(a, b, sizes=[4], dstr=[-1], sstr=[1])
    with pytest.raises(ValueError, match="differ in length"):
        _call(a, b, sizes=[4, 2], dstr=[1], sstr=[1, 4])
    with pytest.raises(ValueError, match="at most 16"):
        _call(a, b, sizes=[1] * 17, dstr=[1] * 17, sstr=[1] * 17)
    with pytest.raises(ValueError, match="overflows"):
        _call(a, b, sizes=[2**40, 2**40], dstr=[1, 1], sstr=[1, 1])
    with pytest.raises(ValueError, match="itemsize"):
        _call(a, b, sizes=[4], dstr=[1], sstr=[1], isz=0)
    _call(a, b, sizes=[0, 8], dstr=[1, 1], sstr=[1, 1])  # empty: nothing, no error


def _engine_planes(kernel: str, dtype: torch.dtype, tokens: int):
    from lmcache_kv_fast.layout.cpu_engine import CpuEngineKV

    spec = CpuEngineKV(8, 8, 128, dtype, 128, kernel)
    g = torch.Generator().manual_seed(tokens)
    kv = torch.empty(2, 8, tokens, 1024, dtype=dtype)
    kv.view(torch.int16 if dtype.itemsize == 2 else torch.int32).random_(generator=g)
    return spec, kv


@pytest.mark.parametrize("kernel,dtype", [("vec", torch.bfloat16), ("vec", torch.float32),
                                          ("amx", torch.bfloat16)])
@pytest.mark.parametrize("fault", [False, True])
def test_staged_boxes_of_large_engine_planes_equal_torch(kernel, dtype, fault, monkeypatch):
    """From 4 MiB, a CPU engine's K plane is transposed (layer, block) by (layer, block)
    through per-thread staging buffers (both sides contiguous per box): both directions
    equal torch's copy bit for bit, also when no staging buffer can be had (the tiles
    then run in place)."""
    import lmcache_kv_fast.copy.strided as strided
    from lmcache_kv_fast import _native

    spec, kv = _engine_planes(kernel, dtype, 1024)  # 32-64 MiB: planes of 16-32 MiB
    with monkeypatch.context() as m:
        m.setattr(strided, "copy_view", lambda d, s: d.copy_(s))
        want_raw = spec.to_raw(kv)
    stats0 = _native.copy_stats()
    _native._set_box_staging_fault(fault)
    try:
        raw = spec.to_raw(kv)
        back = spec.to_tokens(raw)
    finally:
        _native._set_box_staging_fault(False)
    stats1 = _native.copy_stats()
    moved = stats1["staged_box_bytes"] - stats0["staged_box_bytes"]
    direct = stats1["staged_box_direct_bytes"] - stats0["staged_box_direct_bytes"]
    if fault:
        assert moved == 0 and direct == 0
    else:  # at least both K planes went through boxes
        assert moved >= kv.numel() * kv.element_size()
        # vec bf16: 32 x 32 16-bit tiles, streamed straight from the staged source (AVX2)
        tile32 = kernel == "vec" and dtype == torch.bfloat16 and _native.config()[
            "stream_isa"] in ("avx2", "avx512")
        assert (direct == moved) if tile32 else (direct == 0), (direct, moved)
    assert torch.equal(raw.view(torch.uint8), want_raw.view(torch.uint8))
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("seed", range(6))
def test_large_dense_permutations_equal_torch(seed):
    """Permutations of dense 4-16 MiB tensors (boxes wherever the tile and the innermost
    outer dimensions cover a contiguous range on both sides) equal torch's copy."""
    rng = random.Random(seed)
    shape = [rng.choice([8, 16, 32, 64]) for _ in range(4)]
    while torch.Size(shape).numel() * 2 < (4 << 20):
        shape[rng.randrange(4)] *= 2
    perm = list(range(4))
    rng.shuffle(perm)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-2**15, 2**15 - 1, shape, generator=g, dtype=torch.int16)
    src_view = src.permute(*perm)
    dst = torch.empty(src_view.shape, dtype=torch.int16)
    copy_view(dst, src_view)
    assert torch.equal(dst, src_view.contiguous())


def test_staged_tiles_can_be_turned_off_by_the_environment():
    """LMCACHE_KV_FAST_STAGED_TILES=0: the same bytes, no box staged."""
    import os
    import subprocess
    import sys

    code = ("import torch; from lmcache_kv_fast import _native; "
            "from lmcache_kv_fast.layout.cpu_engine import CpuEngineKV; "
            "spec = CpuEngineKV(8, 8, 128, torch.bfloat16, 128, 'vec'); "
            "kv = torch.arange(2 * 8 * 512 * 1024, dtype=torch.int32).to(torch.int16)"
            ".view(torch.bfloat16).view(2, 8, 512, 1024); "
            "assert torch.equal(spec.to_tokens(spec.to_raw(kv)).view(torch.int16), "
            "kv.view(torch.int16)); print(_native.copy_stats()['staged_box_bytes'])")
    for value, staged in (("0", False), ("1", True)):
        env = dict(os.environ, LMCACHE_KV_FAST_STAGED_TILES=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        assert (int(out.stdout.strip()) > 0) is staged, (value, out.stdout)
