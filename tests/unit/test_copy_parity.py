"""Native vs torch copy backends: bit-exact parity on randomized cases.

Every case scatters a random tensor into real POSIX SHM slots with both backends (into
disjoint slot sets of one segment) and compares the bytes, then gathers back into
destinations with an identical random background and compares those. Cases cover
1-64 layers, D 64..4096, chunk sizes 16..512, bf16/fp16/fp32/int8/float64, random chunk
subsets in random order, P=1 and P=2, rank-3 tensors, tensor-parallel shard copies
(W < Dfull at col_offset), tensors longer than the hit, and Region.of_tensor regions.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from conftest import create_shm_segment

pytest.importorskip("lmcache_kv_fast._native")

from lmcache_kv_fast import _native
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy import torch_backend as tb
from lmcache_kv_fast.copy.base import ChunkGeometry, Region

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover - exercised only without hypothesis
    HAVE_HYPOTHESIS = False

SEGMENT_BYTES = 96 << 20
MAX_CASE_BYTES = 3 << 20  # tensor bytes per case (keeps the whole file to a few seconds)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64]
PAGE = 4096


@dataclass(frozen=True)
class _Slot:
    offset: int
    length: int


@dataclass
class Segments:
    name: str
    native: nb.NativeSegment
    torch: tb.TorchSegment


@pytest.fixture(scope="module")
def segs() -> Iterator[Segments]:
    name = create_shm_segment(SEGMENT_BYTES, "parity")
    try:
        n = nb.open_segment(name)
        t = tb.open_segment(name)
        try:
            yield Segments(name, n, t)
        finally:
            n.close()
            t.close()
    finally:
        os.unlink(f"/dev/shm/{name}")


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
                   ) -> torch.Tensor:
    """Random bit patterns (NaNs included) so parity is checked on raw bytes."""
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = n * itemsize
    words = torch.randint(-(2**63), 2**63 - 1, ((nbytes + 7) // 8,), dtype=torch.int64,
                          generator=gen)
    return words.view(torch.uint8)[:nbytes].clone().view(dtype).view(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Case:
    planes: int
    layers: int
    chunk_tokens: int
    dfull: int
    world: int
    rank: int
    dtype: torch.dtype
    n_chunks: int
    extra_tokens: int
    hit: list[int]
    rank3: bool
    seed: int

    @property
    def width(self) -> int:
        return self.dfull // self.world

    @property
    def col_offset(self) -> int:
        return self.rank * self.width

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def tokens(self) -> int:
        return self.n_chunks * self.chunk_tokens + self.extra_tokens

    def geom(self) -> ChunkGeometry:
        return ChunkGeometry(self.planes, self.layers, self.chunk_tokens, self.width,
                             self.itemsize)

    def shape(self) -> tuple[int, ...]:
        if self.rank3:
            return (self.layers, self.tokens, self.dfull)
        return (self.planes, self.layers, self.tokens, self.dfull)


def make_case(rng: random.Random) -> Case:
    dtype = rng.choice(DTYPES)
    itemsize = torch.empty((), dtype=dtype).element_size()
    planes = rng.choice([1, 2])
    dfull = rng.choice([64, 128, 192, 256, 512, 1024, 2048, 4096])
    world = rng.choice([w for w in (1, 1, 2, 4, 8) if dfull % w == 0 and dfull // w >= 8])
    chunk_tokens = rng.choice([16, 32, 48, 64, 100, 128, 256, 512])
    layers = rng.randint(1, 64)
    n_chunks = rng.randint(1, 6)
    # Shrink until the tensor fits the per-case budget.
    while planes * layers * n_chunks * chunk_tokens * dfull * itemsize > MAX_CASE_BYTES:
        if layers > 1:
            layers = max(1, layers // 2)
        elif n_chunks > 1:
            n_chunks -= 1
        elif chunk_tokens > 16:
            chunk_tokens //= 2
        else:
            dfull //= 2
            world = 1
    extra = rng.choice([0, 0, rng.randint(1, chunk_tokens - 1), chunk_tokens])
    total_chunks = n_chunks + extra // chunk_tokens
    k = rng.randint(1, total_chunks)
    hit = rng.sample(range(total_chunks), k)  # random subset in random order
    return Case(planes, layers, chunk_tokens, dfull, world, rng.randrange(world), dtype,
                n_chunks, extra, hit, planes == 1 and rng.random() < 0.5,
                rng.randrange(1 << 30))


def _slots(case: Case, base: int) -> list[_Slot]:
    nbytes = case.geom().chunk_nbytes
    stride = (nbytes + PAGE - 1) // PAGE * PAGE
    return [_Slot(base + j * stride, nbytes) for j in range(len(case.hit))]


def check_case(case: Case, segs: Segments) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    geom = case.geom()
    src = _random_tensor(case.shape(), case.dtype, gen)
    half = SEGMENT_BYTES // 2
    slots_t = _slots(case, 0)
    slots_n = _slots(case, half)
    assert slots_t[-1].offset + geom.chunk_nbytes <= half
    regs_t = segs.torch.regions(slots_t, geom.chunk_nbytes, PAGE)
    regs_n = segs.native.regions(slots_n, geom.chunk_nbytes, PAGE)
    # Scatter: identical bytes in both slot sets.
    tb.scatter(src, geom, case.hit, regs_t, col_offset=case.col_offset)
    nb.scatter(src, geom, case.hit, regs_n, col_offset=case.col_offset)
    for rt, rn in zip(regs_t, regs_n, strict=True):
        assert rt.tensor is not None
        off = rn.addr - segs.native.mapping.address
        view_n = segs.torch._flat[off:off + rn.nbytes]
        assert torch.equal(rt.tensor, view_n), f"scatter mismatch for {case}"
    # Gather into identical random backgrounds: only the hit columns/tokens change.
    background = _random_tensor(case.shape(), case.dtype, gen)
    dst_t, dst_n = background.clone(), background.clone()
    tb.gather(dst_t, geom, case.hit, regs_t, col_offset=case.col_offset)
    nb.gather(dst_n, geom, case.hit, regs_n, col_offset=case.col_offset)
    assert torch.equal(_bytes(dst_t), _bytes(dst_n)), f"gather mismatch for {case}"
    # And the gathered chunks really are the source's.
    s4 = src if src.dim() == 4 else src.unsqueeze(0)
    d4 = dst_n if dst_n.dim() == 4 else dst_n.unsqueeze(0)
    c, w, off = case.chunk_tokens, case.width, case.col_offset
    for i in case.hit:
        assert torch.equal(_bytes(d4[:, :, i * c:(i + 1) * c, off:off + w]),
                           _bytes(s4[:, :, i * c:(i + 1) * c, off:off + w]))


if HAVE_HYPOTHESIS:

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(seed=st.integers(min_value=0, max_value=2**32 - 1))
    def test_parity_randomized(seed: int, segs: Segments) -> None:
        check_case(make_case(random.Random(seed)), segs)

else:  # pragma: no cover

    @pytest.mark.parametrize("seed", range(60))
    def test_parity_randomized(seed: int, segs: Segments) -> None:
        check_case(make_case(random.Random(seed)), segs)


@pytest.mark.parametrize("seed", range(12))
def test_parity_seeded(seed: int, segs: Segments) -> None:
    """A fixed seeded sweep that runs with or without hypothesis."""
    check_case(make_case(random.Random(1000 + seed)), segs)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parity_large_multithreaded(threads: int, segs: Segments) -> None:
    """Large enough to go through the pool (and the streaming kernel)."""
    old = nb.get_threads()
    nb.set_threads(threads)
    try:
        for rank3, world, rank in [(False, 1, 0), (False, 4, 3), (True, 2, 1)]:
            case = Case(planes=1 if rank3 else 2, layers=2, chunk_tokens=256, dfull=1024,
                        world=world, rank=rank, dtype=torch.bfloat16, n_chunks=6,
                        extra_tokens=100, hit=[5, 0, 4, 2, 3], rank3=rank3, seed=threads)
            check_case(case, segs)
    finally:
        nb.set_threads(old)


@pytest.mark.parametrize("kernel", ["libc", "stream", "stream_avx2", "stream_sse2"])
def test_parity_every_kernel(kernel: str, segs: Segments) -> None:
    old = _native.get_copy_kernel()
    _native.set_copy_kernel(kernel)
    try:
        for seed in range(3):
            check_case(make_case(random.Random(77 + seed)), segs)
    finally:
        _native.set_copy_kernel(old)


def test_parity_single_chunk_whole_tensor(segs: Segments) -> None:
    """T == C: runs coalesce across (p, l) into one contiguous copy."""
    case = Case(planes=2, layers=4, chunk_tokens=64, dfull=256, world=1, rank=0,
                dtype=torch.float32, n_chunks=1, extra_tokens=0, hit=[0], rank3=False, seed=5)
    check_case(case, segs)


def _tensor_regions(n: int, geom: ChunkGeometry, dtype: torch.dtype, gen: torch.Generator
                    ) -> list[Region]:
    return [Region.of_tensor(_random_tensor(geom.object_shape(), dtype, gen)) for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_tensor_regions(dtype: torch.dtype) -> None:
    """Regions built with Region.of_tensor (the pickle plane) work with both backends."""
    gen = torch.Generator().manual_seed(3)
    itemsize = torch.empty((), dtype=dtype).element_size()
    geom = ChunkGeometry(2, 3, 32, 64, itemsize)
    src = _random_tensor((2, 3, 32 * 5 + 7, 128), dtype, gen)
    hit = [4, 1, 3]
    regs_t = _tensor_regions(3, geom, dtype, gen)
    regs_n = _tensor_regions(3, geom, dtype, gen)
    tb.scatter(src, geom, hit, regs_t, col_offset=64)
    nb.scatter(src, geom, hit, regs_n, col_offset=64)
    for a, b in zip(regs_t, regs_n, strict=True):
        assert a.tensor is not None and b.tensor is not None
        assert torch.equal(a.tensor, b.tensor)
    bg = _random_tensor(tuple(src.shape), dtype, gen)
    d_t, d_n = bg.clone(), bg.clone()
    tb.gather(d_t, geom, hit, regs_t, col_offset=64)
    nb.gather(d_n, geom, hit, regs_n, col_offset=64)
    assert torch.equal(_bytes(d_t), _bytes(d_n))


def test_parity_duplicates_last_wins() -> None:
    """Duplicate chunk ids in a gather / the same region twice in a scatter: the native
    backend keeps the sequential last-write-wins result of the torch backend."""
    gen = torch.Generator().manual_seed(9)
    geom = ChunkGeometry(2, 2, 16, 32, 4)
    src = _random_tensor((2, 2, 64, 32), torch.float32, gen)
    regs = _tensor_regions(3, geom, torch.float32, gen)
    bg = _random_tensor((2, 2, 64, 32), torch.float32, gen)
    d_t, d_n = bg.clone(), bg.clone()
    tb.gather(d_t, geom, [1, 1, 2], regs)
    nb.gather(d_n, geom, [1, 1, 2], regs)
    assert torch.equal(_bytes(d_t), _bytes(d_n))
    shared = Region.of_tensor(torch.zeros(geom.object_shape()))
    other = Region.of_tensor(torch.zeros(geom.object_shape()))
    tb.scatter(src, geom, [0, 3], [shared, shared])
    expect = shared.tensor.clone()  # type: ignore[union-attr]
    nb.scatter(src, geom, [0, 3], [other, other])
    assert torch.equal(expect, other.tensor)


def test_gather_into_alloc_result(segs: Segments) -> None:
    """alloc_result tensors are ordinary destinations, from the pool or fresh."""
    gen = torch.Generator().manual_seed(11)
    geom = ChunkGeometry(2, 16, 256, 512, 2)
    src = _random_tensor((2, 16, 1024, 512), torch.bfloat16, gen)
    slots = _slots(Case(2, 16, 256, 512, 1, 0, torch.bfloat16, 4, 0, [0, 1, 2, 3], False, 0), 0)
    regs = segs.native.regions(slots, geom.chunk_nbytes, PAGE)
    nb.scatter(src, geom, [0, 1, 2, 3], regs)
    for _ in range(3):  # first fresh, then recycled
        out = nb.alloc_result(src.shape, src.dtype)
        nb.gather(out, geom, [0, 1, 2, 3], regs)
        assert torch.equal(_bytes(out), _bytes(src))
        del out


@pytest.mark.parametrize("kernel", ["stream", "stream_avx2", "stream_sse2"])
@pytest.mark.parametrize("pages", [1, 3, 8, 64])
def test_streaming_interleave_exact(kernel: str, pages: int) -> None:
    """Streaming copies walking several 4 KiB pages in lock step copy every byte exactly.

    Lengths and offsets straddle the interleaved blocks (pages x 4 KiB), the alignment
    head and the linear tail; the bytes around the destination stay untouched.
    """
    old_kernel, old_pages = _native.get_copy_kernel(), _native.get_stream_interleave()
    rng = random.Random(pages * 31 + len(kernel))
    size = 3 << 20
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    dst = torch.zeros(size + 256, dtype=torch.uint8)
    _native.set_copy_kernel(kernel)
    _native.set_stream_interleave(pages)
    try:
        block = pages * 4096
        lengths = [block, block + 1, 2 * block - 64, 2 * block + 4095, 5 * block + 257,
                   rng.randrange(block, size - 128), size - 128, 300, 64 * 1024 + 17]
        for n in lengths:
            n = min(n, size - 128)
            so, do = rng.randrange(0, 128), rng.randrange(0, 128)
            dst.fill_(0xA5)
            _native.memcpy(dst.data_ptr() + do, src.data_ptr() + so, n)
            assert torch.equal(dst[do:do + n], src[so:so + n]), (kernel, pages, n, so, do)
            assert bool((dst[:do] == 0xA5).all()) and bool((dst[do + n:] == 0xA5).all())
    finally:
        _native.set_copy_kernel(old_kernel)
        _native.set_stream_interleave(old_pages)


@pytest.mark.parametrize("bad", [0, -1, 65])
def test_streaming_interleave_rejects_out_of_range(bad: int) -> None:
    old = _native.get_stream_interleave()
    with pytest.raises(ValueError, match=r"pages must be in \[1, 64\]"):
        _native.set_stream_interleave(bad)
    assert _native.get_stream_interleave() == old == _native.config()["stream_interleave"]
