"""Odd tensors at the copy boundary (issue 19 items 3, 4, 7), both backends and the core.

* A KV tensor (source) or ``out`` (destination) whose storage was shrunk
  (``untyped_storage().resize_(4096)``), freed (``resize_(0)``: null data pointer) or
  that is a view reaching past its storage's end: ``InvalidArgumentError`` naming the
  tensor, before any byte moves (before: the native core read / wrote out of bounds,
  SIGSEGV; the torch backend raised a bare RuntimeError).
* The core itself refuses a tensor span too small for the shape or null
  (``_native.TensorSpanError``, a ValueError); its raw-address ``memcpy`` refuses
  unmapped ranges.
* Region tensors with a shrunk storage are refused.
* Negative / conjugate bits: a source is resolved (the stored bytes are its logical
  values; before, the native backend stored the raw bytes: ``-kv``), a destination is
  refused (before, the native backend left it reading back negated).
* ``set_threads`` out of range: ``InvalidArgumentError`` naming ``copy_threads``.

The crash cases also run with large tensors in a subprocess, so a regression shows as a
failed exit status instead of killing pytest.
"""

from __future__ import annotations

import ctypes
import os
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from conftest import assert_script_refuses, create_shm_segment

pytest.importorskip("lmcache_kv_fast._native")

from lmcache_kv_fast import InvalidArgumentError, InvalidTypeError, _native
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy import torch_backend as tb
from lmcache_kv_fast.copy.base import MAX_COPY_THREADS, ChunkGeometry, Region
from lmcache_kv_fast.copy.tensor_checks import (
    check_destination,
    check_source,
    check_storage,
    extent_bytes,
)

P, L, C, D = 2, 2, 16, 64
T = 4 * C
N_CHUNKS = T // C
GEOM = ChunkGeometry(P, L, C, D, 4)
SEG_BYTES = 1 << 20
BACKENDS = {"native": nb, "torch": tb}


@dataclass(frozen=True)
class _Slot:
    offset: int
    length: int


@pytest.fixture(scope="module")
def seg_name() -> Iterator[str]:
    name = create_shm_segment(SEG_BYTES, "oddtensors")
    try:
        yield name
    finally:
        os.unlink(f"/dev/shm/{name}")


RegionMaker = Callable[[ModuleType, ChunkGeometry], list[Region]]


@pytest.fixture(params=["tensor", "segment"])
def make_regions(request: pytest.FixtureRequest, seg_name: str) -> Iterator[RegionMaker]:
    """Regions over fresh tensors, or over a real SHM segment opened by the backend."""
    opened: list = []

    def make(be: ModuleType, geom: ChunkGeometry = GEOM) -> list[Region]:
        n = geom.chunk_nbytes
        if request.param == "tensor":
            return [Region.of_tensor(torch.full((n,), 0x5A, dtype=torch.uint8))
                    for _ in range(N_CHUNKS)]
        seg = be.open_segment(seg_name)
        opened.append(seg)
        regs = seg.regions([_Slot(i * n, n) for i in range(N_CHUNKS)], n, 4096)
        for r in regs:
            _region_bytes(r).fill_(0x5A)
        return regs

    try:
        yield make
    finally:
        for s in opened:
            s.close()


def _region_bytes(r: Region) -> torch.Tensor:
    """The region's bytes as a uint8 tensor (a view, not a copy)."""
    if r.tensor is not None:
        return r.tensor
    m = r.mapping  # type: ignore[attr-defined]
    assert m.address <= r.addr and r.addr + r.nbytes <= m.address + m.size
    return torch.frombuffer((ctypes.c_uint8 * r.nbytes).from_address(r.addr), dtype=torch.uint8)


def _kv(seed: int = 0, dtype: torch.dtype = torch.float32, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(P, L, T, d, generator=g, dtype=dtype)
    return torch.randn(P, L, T, d, generator=g).to(dtype)


def _untouched(regs: list[Region]) -> bool:
    return all(bool((_region_bytes(r) == 0x5A).all()) for r in regs)


def _shrunk(t: torch.Tensor, nbytes: int = 4096) -> torch.Tensor:
    t.untyped_storage().resize_(nbytes)
    return t


def _past_end() -> torch.Tensor:
    """A contiguous [P, L, T, D] view at storage offset 100 whose storage then shrank."""
    numel = P * L * T * D
    flat = torch.zeros(100 + numel)
    kv = flat[100:].view(P, L, T, D)
    flat.untyped_storage().resize_((100 + numel // 2) * 4)
    return kv


def _offset_past_storage() -> torch.Tensor:
    """A view whose storage offset itself now lies past the (shrunk) storage's end."""
    flat = torch.zeros(4096 + P * L * T * D)
    kv = flat[4096:].view(P, L, T, D)
    flat.untyped_storage().resize_(1024)
    return kv


BAD_TENSORS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "shrunk": (lambda: _shrunk(_kv()), "holds only 4096 bytes"),
    "freed": (lambda: _shrunk(_kv(), 0), "freed"),
    "view_past_end": (_past_end, "storage offset 100"),
    "offset_past_storage": (_offset_past_storage, "holds only 1024 bytes"),
}


# --------------------------------------------------------------------------- storage


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_TENSORS)
@pytest.mark.parametrize(("op", "name"), [("scatter", "kv"), ("gather", "out")],
                         ids=["source", "destination"])
def test_bad_storage_refused(op: str, name: str, backend: str, case: str,
                             make_regions: RegionMaker) -> None:
    """A bad source (``kv`` of a scatter) or destination (``out`` of a gather) is refused
    by name before any slot is touched."""
    be = BACKENDS[backend]
    regs = make_regions(be)
    make, text = BAD_TENSORS[case]
    with pytest.raises(InvalidArgumentError, match=text) as info:
        getattr(be, op)(make(), GEOM, range(N_CHUNKS), regs)
    assert str(info.value).startswith(f"{name} ")
    assert _untouched(regs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_names_the_tensor(backend: str) -> None:
    be = BACKENDS[backend]
    regs = [Region.of_tensor(torch.zeros(GEOM.chunk_nbytes, dtype=torch.uint8))]
    with pytest.raises(InvalidArgumentError, match=r"^batch kv 3 has shape"):
        be.scatter(_shrunk(_kv()), GEOM, [0], regs, what="batch kv 3")
    with pytest.raises(InvalidArgumentError, match=r"^dst has shape"):
        be.gather(_shrunk(_kv()), GEOM, [0], regs, what="dst")


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrunk_region_tensor_refused(backend: str) -> None:
    be = BACKENDS[backend]
    bufs = [torch.zeros(GEOM.chunk_nbytes, dtype=torch.uint8) for _ in range(2)]
    regs = [Region.of_tensor(b) for b in bufs]
    bufs[1].untyped_storage().resize_(64)
    kv = _kv()
    with pytest.raises(ValueError, match="region 1"):
        be.scatter(kv, GEOM, [0, 1], regs)
    with pytest.raises(ValueError, match="region 1"):
        be.gather(kv.clone(), GEOM, [0, 1], regs)
    assert bool((bufs[0] == 0).all())  # nothing copied, not even the good region


def test_core_refuses_short_or_null_tensor_span() -> None:
    """The core checks the span it is given (the backend passes the storage's real bytes)."""
    t = _kv()
    regs = [Region.of_tensor(torch.zeros(GEOM.chunk_nbytes, dtype=torch.uint8))]
    base = [t.data_ptr(), t.nbytes, (P, L, T, D), 4, D, 0, C, [0], [regs[0].addr],
            [regs[0].nbytes], None]
    _native.scatter(*base)  # sane
    for idx, value, text in ((1, t.nbytes - 1, "fewer than"), (1, 4096, "holds 4096 bytes"),
                             (0, 0, "null tensor address")):
        args = list(base)
        args[idx] = value
        for fn in (_native.scatter, _native.gather):
            with pytest.raises(_native.TensorSpanError, match=text):
                fn(*args)
    assert issubclass(_native.TensorSpanError, ValueError)


def test_core_memcpy_refuses_unmapped_ranges() -> None:
    """The raw-address helper refuses a range with a hole (a freed buffer) instead of faulting."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = os.sysconf("SC_PAGE_SIZE")
    prot_rw, map_private_anon = 0x1 | 0x2, 0x02 | 0x20
    base = libc.mmap(None, 3 * page, prot_rw, map_private_anon, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    try:
        assert libc.munmap(base + page, page) == 0  # a hole in the middle
        src = torch.ones(2 * page, dtype=torch.uint8)
        _native.memcpy(base, src.data_ptr(), page)  # the first page is fine
        for dst, n in ((base, 2 * page), (base + page - 8, 16), (base + 2 * page - 1, 2)):
            with pytest.raises(ValueError, match="memcpy dst.*not .*mapped"):
                _native.memcpy(dst, src.data_ptr(), n)
        with pytest.raises(ValueError, match="memcpy src.*not .*mapped"):
            _native.memcpy(src.data_ptr(), base, 2 * page)
    finally:
        libc.munmap(base, page)
        libc.munmap(base + 2 * page, page)


# --------------------------------------------------------------------------- neg / conj bits


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_source_stores_logical_values(backend: str, make_regions: RegionMaker) -> None:
    be = BACKENDS[backend]
    regs = make_regions(be)
    kv = _kv(1)
    neg = torch._neg_view(kv)
    assert neg.is_neg() and neg.data_ptr() == kv.data_ptr()
    be.scatter(neg, GEOM, range(N_CHUNKS), regs)
    logical = neg.resolve_neg()
    for i, r in enumerate(regs):
        got = _region_bytes(r).view(torch.float32).view(GEOM.object_shape())
        assert torch.equal(got, logical[:, :, i * C:(i + 1) * C]), f"chunk {i}"
        assert torch.equal(got, -kv[:, :, i * C:(i + 1) * C])
    assert not kv.is_neg() and torch.equal(torch._neg_view(neg), kv)  # caller's tensor kept


@pytest.mark.parametrize("backend", BACKENDS)
def test_conj_source_stores_logical_values(backend: str) -> None:
    be = BACKENDS[backend]
    kv = _kv(2, torch.complex64, d=D // 2)
    geom = ChunkGeometry(P, L, C, D // 2, 8)
    regs = [Region.of_tensor(torch.zeros(geom.chunk_nbytes, dtype=torch.uint8))
            for _ in range(N_CHUNKS)]
    for src in (kv.conj(), torch._neg_view(kv.conj())):
        assert src.is_conj()
        be.scatter(src, geom, range(N_CHUNKS), regs)
        logical = src.resolve_conj().resolve_neg()
        for i, r in enumerate(regs):
            got = r.tensor.view(torch.complex64).view(geom.object_shape())  # type: ignore[union-attr]
            assert torch.equal(got, logical[:, :, i * C:(i + 1) * C]), f"chunk {i}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bit", ["neg", "conj"])
def test_neg_or_conj_destination_refused(backend: str, bit: str) -> None:
    be = BACKENDS[backend]
    if bit == "neg":
        geom, buf = GEOM, torch.full((P, L, T, D), 7.0)
        dst = torch._neg_view(buf)
    else:
        geom, buf = ChunkGeometry(P, L, C, D // 2, 8), torch.full((P, L, T, D // 2), 7 + 0j)
        dst = buf.conj()
    src = torch.zeros_like(buf)
    regs = [Region.of_tensor(torch.zeros(geom.chunk_nbytes, dtype=torch.uint8))
            for _ in range(N_CHUNKS)]
    be.scatter(src, geom, range(N_CHUNKS), regs)
    name = "negative" if bit == "neg" else "conjugate"
    with pytest.raises(InvalidArgumentError, match=f"out has the {name} bit"):
        be.gather(dst, geom, range(N_CHUNKS), regs)
    assert bool((buf == 7).all())  # nothing written


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_roundtrip_unchanged(backend: str, make_regions: RegionMaker) -> None:
    """The checks cost no behaviour: a normal scatter / gather round-trips bit-exactly."""
    be = BACKENDS[backend]
    regs = make_regions(be)
    kv = _kv(3)
    be.scatter(kv, GEOM, range(N_CHUNKS), regs)
    out = be.alloc_result(kv.shape, kv.dtype)
    be.gather(out, GEOM, range(N_CHUNKS), regs)
    assert torch.equal(out, kv)


# --------------------------------------------------------------------------- shared checks


def test_check_storage_strided_views() -> None:
    base = torch.zeros(4, 8, 16)
    t = base.transpose(0, 2)  # non-contiguous, full extent
    assert extent_bytes(t) == base.nbytes
    assert check_storage(t, "kv") == base.nbytes
    e = torch.zeros(1, 16).expand(32, 16)  # stride 0
    assert extent_bytes(e) == 16 * 4
    check_storage(e, "kv")
    part = base[1:3, :, 4:8]
    assert check_storage(part, "kv") == base.nbytes - part.storage_offset() * 4
    base.untyped_storage().resize_(64 * 4)
    with pytest.raises(InvalidArgumentError, match="kv has shape \\[16, 8, 4\\]"):
        check_source(t, "kv")  # checked before anything reads it (resolve / contiguous)
    with pytest.raises(InvalidArgumentError):
        check_destination(part, "out")


def test_check_storage_empty_and_odd_tensors() -> None:
    empty = torch.zeros(2, 0, 8)
    empty.untyped_storage().resize_(0)
    assert check_storage(empty, "kv") == 0  # nothing to touch: fine
    with pytest.raises(InvalidArgumentError, match="kv is on device meta"):
        check_source(torch.zeros(4, device="meta"), "kv")
    with pytest.raises(InvalidArgumentError, match="no accessible storage"):
        check_source(torch.zeros(4, 4).to_sparse(), "kv")
    plain = _kv()
    assert check_source(plain, "kv") is plain  # no copy for an ordinary tensor
    assert check_destination(plain, "out") is plain


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_threads_range(backend: str) -> None:
    be = BACKENDS[backend]
    before = be.get_threads()
    for bad in (0, -1, MAX_COPY_THREADS + 1, 100000, 2**40):
        with pytest.raises(InvalidArgumentError, match=r"copy_threads must be in \[1, 1024\]"):
            be.set_threads(bad)
    for bad in (True, 2.0, "2", None):
        with pytest.raises(InvalidTypeError, match="copy_threads"):
            be.set_threads(bad)
    assert be.get_threads() == before
    assert MAX_COPY_THREADS == _native.MAX_THREADS == 1024


# --------------------------------------------------------------------------- crash guard


CRASH_SCRIPT = textwrap.dedent("""
    import torch
    from lmcache_kv_fast import InvalidArgumentError
    from lmcache_kv_fast.copy import native_backend as nb, torch_backend as tb
    from lmcache_kv_fast.copy.base import ChunkGeometry, Region

    P, L, T, D, C = 2, 8, 2048, 256, 256   # 32 MiB of float32: freed storage is unmapped
    geom = ChunkGeometry(P, L, C, D, 4)
    n = T // C
    refused = 0
    for be in (nb, tb):
        regs = [Region.of_tensor(torch.zeros(geom.chunk_nbytes, dtype=torch.uint8))
                for _ in range(n)]
        for size in (4096, 0):
            for fn in (be.scatter, be.gather):
                t = torch.randn(P, L, T, D)
                t.untyped_storage().resize_(size)
                try:
                    fn(t, geom, range(n), regs)
                except InvalidArgumentError:
                    refused += 1
        out = torch._neg_view(torch.empty(P, L, T, D))
        try:
            be.gather(out, geom, range(n), regs)
        except InvalidArgumentError:
            refused += 1
    print("REFUSED", refused)
""")


def test_large_odd_tensors_in_subprocess() -> None:
    assert_script_refuses(CRASH_SCRIPT, 10, timeout=300)
