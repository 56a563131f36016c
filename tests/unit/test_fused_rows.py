"""``fused_rows``: a token gather (K optionally re-rotated) from chunk regions into chunk regions.

The native kernel (csrc/fused_rows.cpp) against the torch backend's reference and against a
plain torch computation on the assembled tensors (``index_select``, ``edits.rerotate``),
bit for bit: index shapes (drop-every-k, random keep sets, duplicates, rows crossing chunk
boundaries), destination subsets, dtypes, rotary layouts, planes, sharded widths; regions
in a real POSIX shm segment and in tensors; every refused call leaves the destinations
untouched; racing callers. No server needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from conftest import run_threads
from fused_support import (
    SENTINEL,
    Slot,
    assert_bits_as_torch,
    assert_refused,
    case_blank,
    case_chunk_ids,
    case_index,
    edge_rotation,
    edge_values,
    pool_for_every_call,
    rotation_for,
    span,
)

from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy import torch_backend as tb
from lmcache_kv_fast.copy.base import ChunkGeometry, Region
from lmcache_kv_fast.copy.edit_kernels import Rotation
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class Case:
    """One fused_rows call: geometry, the index, the rotation and which chunks are written."""

    planes: int = 2
    layers: int = 3
    chunk: int = 16
    width: int = 256  # elements per row of one object (one shard's heads)
    n_src: int = 8
    dtype: torch.dtype = torch.bfloat16
    index: str = "drop10"  # drop10 | keep | dups | shift
    rope: str | None = None  # default | llama3 | partial (None: plain)
    interleaved: bool = False
    subset: bool = False  # write only some output chunks, in a shuffled order

    @property
    def geom(self) -> ChunkGeometry:
        """The chunk objects' geometry."""
        return ChunkGeometry(self.planes, self.layers, self.chunk, self.width,
                             self.dtype.itemsize)


ROPES = {
    "default": {},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}},
    "partial": {"partial_rotary_factor": 0.5},
}

CASES = {
    "drop10-plain": Case(),
    "drop10-neox": Case(rope="default"),
    "drop10-llama3": Case(rope="llama3"),
    "keep-interleaved": Case(index="keep", rope="default", interleaved=True),
    "keep-partial": Case(index="keep", rope="partial"),
    "partial-interleaved-f32": Case(index="keep", rope="partial", interleaved=True,
                                    dtype=torch.float32),
    "dups-neox-f32": Case(index="dups", rope="llama3", dtype=torch.float32),
    "shift-plain-f32": Case(index="shift", dtype=torch.float32),
    "subset-neox": Case(index="keep", rope="default", subset=True),
    "subset-plain-dups": Case(index="dups", subset=True),
    "sharded-width": Case(width=128, rope="llama3", index="keep", subset=True),
    "p1-plain-f16": Case(planes=1, dtype=torch.float16, index="dups"),
    "p1-plain-int8": Case(planes=1, dtype=torch.int8, width=100, index="keep"),
    "p1-plain-f64": Case(planes=1, dtype=torch.float64, width=24, chunk=7, n_src=5),
    "one-row-chunks": Case(chunk=1, n_src=40, index="keep", rope="default"),
    "big-chunk": Case(chunk=64, n_src=4, layers=2, index="drop10", rope="llama3"),
}


def _rope(case: Case) -> edits.RoPE:
    cfg = {"model_type": "llama", "head_dim": 64, "rope_theta": 500000.0, **ROPES[case.rope or ""]}
    return dataclasses.replace(edits.rope_from_config(cfg), interleaved=case.interleaved)


def _sources(case: Case, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = case.geom.object_shape()
    if case.dtype.is_floating_point:
        return [(torch.randn(shape, generator=gen) * 3).to(case.dtype) for _ in range(case.n_src)]
    return [torch.randint(-128, 127, shape, generator=gen).to(case.dtype)
            for _ in range(case.n_src)]


def _rotation(case: Case, idx: torch.Tensor) -> Rotation | None:
    return rotation_for(_rope(case) if case.rope is not None else None, idx)


def _plain_torch(case: Case, srcs: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """``[P, L, n_out, W]``: the assembled source's rows, K re-rotated by ``edits.rerotate``."""
    out = torch.cat(srcs, dim=2).index_select(2, idx)
    if case.rope is not None:
        edits.rerotate(out, idx, _rope(case), inplace=True)
    return out


def _run(backend: object, case: Case, srcs: list[torch.Tensor], idx: torch.Tensor,
         ids: list[int], rotation: Rotation | None) -> list[torch.Tensor]:
    dsts = [case_blank(case) for _ in ids]
    backend.fused_rows([Region.of_tensor(s) for s in srcs], ids,  # type: ignore[attr-defined]
                       [Region.of_tensor(d) for d in dsts], idx, case.geom, rotation)
    return dsts


@pytest.mark.parametrize("name", list(CASES))
def test_native_equals_torch_reference_and_plain_torch(name: str) -> None:
    case = CASES[name]
    srcs, idx = _sources(case), case_index(case)
    rotation = _rotation(case, idx)
    ids = case_chunk_ids(case, idx.numel())
    got = _run(nb, case, srcs, idx, ids, rotation)
    ref = _run(tb, case, srcs, idx, ids, rotation)
    c = case.chunk
    plain = _plain_torch(case, srcs, idx) if case.planes == 2 or case.rope is None else None
    for i, g, r in zip(ids, got, ref, strict=True):
        assert torch.equal(g.view(torch.uint8), r.view(torch.uint8)), f"chunk {i}"
        if plain is not None:
            want = plain[:, :, i * c:(i + 1) * c]
            assert torch.equal(g.view(torch.uint8), want.contiguous().view(torch.uint8))
    if case.rope is not None:  # V is moved unchanged, K really turned
        full = torch.cat(srcs, dim=2)
        for i, g in zip(ids, got, strict=True):
            rows = idx[i * c:(i + 1) * c]
            assert torch.equal(g[1], full[1].index_select(1, rows))
            assert not torch.equal(g[0], full[0].index_select(1, rows)) or bool((rows == (
                torch.arange(i * c, (i + 1) * c))).all())


#: The rounding test's layouts: bfloat16 neox with rotary halves of 32 and 16 (the AVX-512
#: BF16 row kernel), interleaved (the AVX-512F one), float32.
EDGE_CASES = {
    "neox": Case(index="keep", rope="default"),
    "partial": Case(index="keep", rope="partial"),
    "interleaved": Case(index="keep", rope="default", interleaved=True),
    "neox-f32": Case(index="keep", rope="default", dtype=torch.float32),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_rotation_rounds_as_torch(name: str) -> None:
    """K's rotation rounds as torch: ties to even, denormal inputs and results kept (the
    BF16 instructions would flush them), the denormal range's top rounding up to the
    smallest normal, +-0, overflows to infinity, infinities and NaNs (payloads aside)."""
    case = EDGE_CASES[name]
    srcs = [edge_values(case.geom.object_shape(), case.dtype, seed) for seed in range(case.n_src)]
    idx, rope = case_index(case), _rope(case)
    rotation = edge_rotation(idx.numel(), rope.head_dim, rope.rotary_dim, case.interleaved, 5)
    ids = case_chunk_ids(case, idx.numel())
    got = _run(nb, case, srcs, idx, ids, rotation)
    ref = _run(tb, case, srcs, idx, ids, rotation)
    for i, g, r in zip(ids, got, ref, strict=True):
        assert_bits_as_torch(g, r, f"chunk {i}")
    k = torch.stack([r[0] for r in ref]).float()
    assert bool(((k != 0) & (k.abs() < 2**-126)).any()), "no denormal result was tested"


#: Streamed runs: aligned rows, 400-byte rows (heads up to a line, tails under 128 bytes),
#: runs of every length, and blocks of more runs than are walked side by side at once.
STREAM_CASES = {
    "drop10": Case(),
    "odd-rows-keep": Case(width=200, index="keep"),
    "dups-subset": Case(index="dups", subset=True),
    "shift-f32": Case(index="shift", dtype=torch.float32),
    "many-runs": Case(chunk=256, n_src=3, layers=1, width=64),
}


@pytest.mark.parametrize("pages", [8, 1])
@pytest.mark.parametrize("name", list(STREAM_CASES))
def test_streamed_runs_equal_torch_reference(name: str, pages: int) -> None:
    """Runs copied with non-temporal stores, several side by side (an interleave of 8
    pages) or one after the other (1, as on AMD), equal the references byte for byte."""
    case = STREAM_CASES[name]
    before = (_native.get_copy_kernel(), _native.get_stream_interleave())
    _native.set_copy_kernel("stream")
    _native.set_stream_interleave(pages)
    try:
        srcs, idx = _sources(case), case_index(case)
        ids = case_chunk_ids(case, idx.numel())
        got = _run(nb, case, srcs, idx, ids, None)
    finally:
        _native.set_copy_kernel(before[0])
        _native.set_stream_interleave(before[1])
    ref = _run(tb, case, srcs, idx, ids, None)
    plain = _plain_torch(case, srcs, idx)
    c = case.chunk
    for i, g, r in zip(ids, got, ref, strict=True):
        assert torch.equal(g.view(torch.uint8), r.view(torch.uint8)), f"chunk {i}"
        assert torch.equal(g, plain[:, :, i * c:(i + 1) * c].contiguous()), f"chunk {i}"


def test_unnamed_output_chunks_stay_untouched() -> None:
    """A destination pool holds every output chunk; only the named ones change."""
    case = Case(index="keep", rope="default")
    srcs, idx = _sources(case), case_index(case)
    n_chunks = idx.numel() // case.chunk
    pool = [case_blank(case) for _ in range(n_chunks)]
    ids = [3, 0, n_chunks - 1]
    nb.fused_rows([Region.of_tensor(s) for s in srcs], ids,
                  [Region.of_tensor(pool[i]) for i in ids], idx, case.geom, _rotation(case, idx))
    plain = _plain_torch(case, srcs, idx)
    for i, t in enumerate(pool):
        if i in ids:
            want = plain[:, :, i * case.chunk:(i + 1) * case.chunk].contiguous()
            assert torch.equal(t, want)
        else:
            assert bool((t.view(torch.uint8) == SENTINEL).all()), f"chunk {i} was written"


def test_regions_larger_than_a_chunk_and_trailing_index() -> None:
    """Slots may be longer than the object (the tail is never touched); index rows past the
    last whole output chunk are allowed (a partial chunk the caller does not write)."""
    case = Case(index="keep")
    srcs, idx = _sources(case), case_index(case)
    nbytes = case.geom.chunk_nbytes
    big_src = [torch.cat([s.reshape(-1).view(torch.uint8), torch.zeros(100, dtype=torch.uint8)])
               for s in srcs]
    big_dst = [torch.full((nbytes + 64,), SENTINEL, dtype=torch.uint8) for _ in range(2)]
    assert idx.numel() % case.chunk
    nb.fused_rows([Region.of_tensor(s) for s in big_src], [1, 0],
                  [Region.of_tensor(d) for d in big_dst], idx, case.geom)
    plain = _plain_torch(case, srcs, idx)
    for i, d in zip([1, 0], big_dst, strict=True):
        want = plain[:, :, i * case.chunk:(i + 1) * case.chunk].contiguous().view(torch.uint8)
        assert torch.equal(d[:nbytes], want.reshape(-1))
        assert bool((d[nbytes:] == SENTINEL).all())


def test_nothing_to_write() -> None:
    case = Case()
    srcs = _sources(case)
    empty = torch.empty(0, dtype=torch.int64)
    for be in (nb, tb):
        be.fused_rows([Region.of_tensor(s) for s in srcs], [], [], empty, case.geom)
        be.fused_rows([], [], [], empty, case.geom)


# ------------------------------------------------------------------ shm regions
@pytest.mark.parametrize("rope", [None, "llama3"])
def test_mapped_and_tensor_regions_mixed(shm_segments: Callable[[int], str], rope: str | None) -> None:
    """Sources and destinations partly in a real shm segment (MappedRegion), partly tensors."""
    case = Case(index="keep", rope=rope, subset=True)
    srcs, idx = _sources(case), case_index(case)
    ids = case_chunk_ids(case, idx.numel())
    rotation = _rotation(case, idx)
    nbytes = case.geom.chunk_nbytes
    n_shm_src, n_shm_dst = case.n_src // 2, len(ids) // 2 + 1
    name = shm_segments((n_shm_src + n_shm_dst) * nbytes)
    seg, view = nb.open_segment(name), tb.open_segment(name)
    try:
        slots = [Slot(k * nbytes, nbytes) for k in range(n_shm_src + n_shm_dst)]
        mapped = seg.regions(slots, nbytes, 64)
        flat = view.regions(slots, nbytes, 64)  # the same bytes, through torch's mmap
        for k in range(n_shm_src):
            flat[k].tensor.copy_(srcs[k].reshape(-1).view(torch.uint8))
        for k in range(n_shm_src, len(slots)):
            flat[k].tensor.fill_(SENTINEL)
        tensor_dsts = [case_blank(case) for _ in ids[n_shm_dst:]]
        src_regions = mapped[:n_shm_src] + [Region.of_tensor(s) for s in srcs[n_shm_src:]]
        dst_regions = mapped[n_shm_src:] + [Region.of_tensor(d) for d in tensor_dsts]
        nb.fused_rows(src_regions, ids, dst_regions, idx, case.geom, rotation)
        got = [f.tensor for f in flat[n_shm_src:]] + [d.reshape(-1).view(torch.uint8)
                                                      for d in tensor_dsts]
        ref = _run(tb, case, srcs, idx, ids, rotation)
        for i, g, r in zip(ids, got, ref, strict=True):
            assert torch.equal(g, r.reshape(-1).view(torch.uint8)), f"chunk {i}"
    finally:
        seg.close()
        view.close()


def test_closed_or_foreign_mapping_refused(shm_segments: Callable[[int], str]) -> None:
    case = Case()
    srcs, idx = _sources(case), case_index(case)
    nbytes = case.geom.chunk_nbytes
    seg = nb.open_segment(shm_segments(2 * nbytes))
    dst = case_blank(case)
    try:
        mapped = seg.regions([Slot(0, nbytes), Slot(nbytes, nbytes)], nbytes, 64)
        forged = nb.MappedRegion(mapped[1].addr + 64, nbytes, None, seg.mapping)
        with pytest.raises(ValueError, match="destination region 0 lies outside segment"):
            nb.fused_rows([Region.of_tensor(s) for s in srcs], [0], [forged], idx, case.geom)
        with pytest.raises(ValueError, match="source region 1 lies outside segment"):
            nb.fused_rows([Region.of_tensor(srcs[0]), forged], [0], [Region.of_tensor(dst)],
                          idx[:16] % 16, case.geom)
        seg.close()
        with pytest.raises(ValueError, match="closed segment"):
            nb.fused_rows(mapped[:1], [0], [Region.of_tensor(dst)], idx[:16] % 16, case.geom)
        assert bool((dst.view(torch.uint8) == SENTINEL).all())
    finally:
        seg.close()


# ------------------------------------------------------------------ refused calls
def _bad_call(bad: str) -> tuple[dict, type[Exception], str]:
    """Arguments of a call that must be refused, the error and a pattern of its message."""
    case = Case(rope="default")
    srcs, idx = _sources(case), case_index(case)
    rotation = _rotation(case, idx)
    assert rotation is not None
    ids = case_chunk_ids(case, idx.numel())
    dsts = [case_blank(case) for _ in ids]
    src_r = [Region.of_tensor(s) for s in srcs]
    dst_r = [Region.of_tensor(d) for d in dsts]
    kw = dict(src_regions=src_r, dst_chunk_ids=ids, dst_regions=dst_r, index=idx,
              geom=case.geom, rotation=rotation, dsts=dsts)
    n_rows = case.n_src * case.chunk
    err: type[Exception] = ValueError
    if bad == "src-short":
        src_r[2] = Region(src_r[2].addr, src_r[2].nbytes - 2, src_r[2].tensor)
        return kw, err, "source region 2 holds"
    if bad == "dst-short":
        dst_r[1] = Region(dst_r[1].addr, dst_r[1].nbytes - 2, dst_r[1].tensor)
        return kw, err, "destination region 1 holds"
    if bad == "ids-count":
        kw["dst_chunk_ids"] = ids[:-1]
        return kw, err, f"{len(ids) - 1} destination chunk ids for {len(ids)} destination regions"
    if bad == "ids-dup":
        kw["dst_chunk_ids"] = [ids[0], *ids[:-1]]
        return kw, err, f"destination chunk id {ids[0]} appears twice"
    if bad == "ids-range":
        kw["dst_chunk_ids"] = [*ids[:-1], len(ids)]
        return kw, err, f"destination chunk id {len(ids) - 1} is {len(ids)}"
    if bad == "ids-negative":
        kw["dst_chunk_ids"] = [-1, *ids[1:]]
        return kw, err, "destination chunk id 0 is -1"
    if bad in ("index-high", "index-negative"):
        idx = idx.clone()
        idx[50] = n_rows if bad == "index-high" else -3
        kw["index"] = idx
        return kw, err, f"index 50 is {int(idx[50])}, outside \\[0, {n_rows}\\)"
    if bad == "overlap-src":
        dst_r[2] = src_r[5]
        return kw, err, "destination region 2 overlaps source region 5"
    if bad == "overlap-dst":
        half = Region(dst_r[1].addr + 64, dst_r[1].nbytes - 64, dst_r[1].tensor)
        big = torch.full((case.geom.chunk_nbytes + 64,), SENTINEL, dtype=torch.uint8)
        kw["dsts"] = [*dsts, big]
        dst_r[1] = Region.of_tensor(big)
        dst_r[3] = Region(dst_r[1].addr + 64, case.geom.chunk_nbytes, big)
        del half
        return kw, err, "destination regions 1 and 3 overlap"
    if bad == "no-tensor":
        src_r[0] = Region(src_r[0].addr, src_r[0].nbytes)
        return kw, err, "source.? region 0 carries"
    if bad in ("heads", "rotary-odd", "rotary-wide", "rotary-zero"):
        change = {"heads": dict(head_dim=48), "rotary-odd": dict(rotary_dim=63),
                  "rotary-wide": dict(rotary_dim=66), "rotary-zero": dict(rotary_dim=0)}[bad]
        kw["rotation"] = rotation._replace(**change)
        return kw, InvalidArgumentError, "heads of 48" if bad == "heads" else "rotary_dim must be"
    if bad in ("cos-shape", "cos-dtype", "sin-strided"):
        t = {"cos-shape": rotation.cos[:-1], "cos-dtype": rotation.cos.double(),
             "sin-strided": rotation.sin.t().contiguous().t()}[bad]
        name = "sin" if bad.startswith("sin") else "cos"
        kw["rotation"] = rotation._replace(**{name: t})
        return kw, InvalidArgumentError, f"rotation.{name}"
    if bad == "rotation-dtype":
        kw["dtype"] = torch.float32
        return kw, InvalidArgumentError, "itemsize 4"
    if bad == "index-dtype":
        kw["index"] = idx.int()
        return kw, InvalidArgumentError, "int64"
    if bad == "index-2d":
        kw["index"] = idx[:112].view(2, 56)
        return kw, InvalidArgumentError, "1-D"
    assert bad == "index-list"
    kw["index"] = idx.tolist()
    return kw, InvalidTypeError, "torch.Tensor"


BAD = ["src-short", "dst-short", "ids-count", "ids-dup", "ids-range", "ids-negative",
       "index-high", "index-negative", "overlap-src", "overlap-dst", "no-tensor", "heads",
       "rotary-odd", "rotary-wide", "rotary-zero", "cos-shape", "cos-dtype", "sin-strided",
       "rotation-dtype", "index-dtype", "index-2d", "index-list"]


@pytest.mark.parametrize("backend", [nb, tb], ids=["native", "torch"])
@pytest.mark.parametrize("bad", BAD)
def test_refused_before_anything_is_written(backend: object, bad: str) -> None:
    assert_refused(backend.fused_rows, *_bad_call(bad))  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", ["cos-span", "sin-span", "idx-span", "overflow", "itemsize",
                                 "odd", "heads", "src-count", "owners-count", "owner-type",
                                 "zero-geometry", "geometry-len", "dtype", "null-addr"])
def test_core_refuses_before_anything_is_written(bad: str) -> None:
    """The core's own checks, called without the Python layer's."""
    case = Case(rope="default")
    srcs, idx = _sources(case), case_index(case)
    rot = _rotation(case, idx)
    assert rot is not None
    dst = case_blank(case)
    g = case.geom
    args = dict(
        src_addrs=[s.data_ptr() for s in srcs], src_nbytes=[g.chunk_nbytes] * len(srcs),
        src_owners=None, dst_ids=[2], dst_addrs=[dst.data_ptr()], dst_nbytes=[g.chunk_nbytes],
        dst_owners=None, idx=span(idx), n_out=idx.numel(),
        geometry=(g.planes, g.layers, g.chunk_tokens, g.width, g.itemsize),
        cos=span(rot.cos), sin=span(rot.sin), head_dim=64, rotary_dim=64, interleaved=False,
        dtype="bfloat16")
    shrink = {"cos-span": "cos", "sin-span": "sin", "idx-span": "idx"}
    pattern, err = "fused_rows", ValueError
    if bad in shrink:
        base, nbytes, off = args[shrink[bad]]  # type: ignore[misc]
        args[shrink[bad]] = (base, nbytes - 4, off)
        pattern = f"{'index' if bad == 'idx-span' else shrink[bad]} needs bytes"
    elif bad == "overflow":
        args["geometry"] = (2, 1 << 40, 1 << 20, 256, 2)
        pattern = "overflows 64 bits"
    elif bad in ("itemsize", "odd", "heads", "dtype"):
        change = {"itemsize": dict(dtype="float32"), "odd": dict(rotary_dim=7),
                  "heads": dict(head_dim=96), "dtype": dict(dtype="float16")}[bad]
        args.update(change)
        pattern = {"itemsize": "needs itemsize 4", "odd": "rotary_dim must be even",
                   "heads": "heads of 96", "dtype": "dtype must be"}[bad]
    elif bad == "src-count":
        args["src_nbytes"] = args["src_nbytes"][:-1]  # type: ignore[index]
        pattern = "source addresses for"
    elif bad == "owners-count":
        args["dst_owners"] = [None, None]
        pattern = "2 owners for 1 destination regions"
    elif bad == "owner-type":
        args["src_owners"], err = [object()] * len(srcs), TypeError
        pattern = "owner 0 is not a Mapping"
    elif bad == "zero-geometry":
        args["geometry"] = (2, 3, 0, 256, 2)
        pattern = "must be >= 1"
    elif bad == "geometry-len":
        args["geometry"] = (2, 3, 16, 256)
        pattern = "geometry must be 5 integers"
    else:
        args["dst_addrs"] = [0]
        pattern = "destination region 0 has a null address"
    with pytest.raises(err, match=pattern):
        _native.fused_rows(**args)
    assert bool((dst.view(torch.uint8) == SENTINEL).all())


# ------------------------------------------------------------------ pool and races
@pytest.fixture
def small_pool_tasks() -> Iterator[None]:
    """Every call on the pool (3 threads), so tasks split the work."""
    with pool_for_every_call(3):
        yield


@pytest.mark.parametrize("name", ["drop10-llama3", "subset-plain-dups", "one-row-chunks"])
def test_pool_split_matches(name: str, small_pool_tasks: None) -> None:
    case = CASES[name]
    srcs, idx = _sources(case), case_index(case)
    rotation = _rotation(case, idx)
    ids = case_chunk_ids(case, idx.numel())
    got = _run(nb, case, srcs, idx, ids, rotation)
    ref = _run(tb, case, srcs, idx, ids, rotation)
    assert all(torch.equal(g.view(torch.uint8), r.view(torch.uint8))
               for g, r in zip(got, ref, strict=True))


def test_racing_threads_agree() -> None:
    """Callers racing for the copy pool (a busy pool runs the job on the caller's thread):
    every result equals the one computed alone."""
    case = Case(layers=8, chunk=64, width=512, index="drop10", rope="llama3")
    srcs, idx = _sources(case), case_index(case)
    rotation = _rotation(case, idx)
    ids = case_chunk_ids(case, idx.numel())
    alone = _run(nb, case, srcs, idx, ids, rotation)
    results: dict[int, list[torch.Tensor]] = {}

    def worker(i: int) -> None:
        for _ in range(3):
            results[i] = _run(nb, case, srcs, idx, ids, rotation)

    assert run_threads(worker, 6) == []
    for got in results.values():
        assert all(torch.equal(g, a) for g, a in zip(got, alone, strict=True))


def test_cold_destinations_on_a_full_file_system_raise_enospc(
        shm_segments: Callable[[int], str]) -> None:
    """Pages not allocated yet are written only with room for them (else SIGBUS): ENOSPC."""
    import errno

    case = Case()
    srcs, idx = _sources(case), case_index(case)
    nbytes = case.geom.chunk_nbytes
    name = shm_segments(nbytes)  # sparse: its pages are not allocated yet
    seg, view = nb.open_segment(name), tb.open_segment(name)
    prev = _native._set_cold_room_margin(1 << 62)  # as if the file system were full
    try:
        dst = seg.regions([Slot(0, nbytes)], nbytes, 64)
        with pytest.raises(OSError) as ei:
            nb.fused_rows([Region.of_tensor(s) for s in srcs], [0], dst, idx[:16] % 16,
                          case.geom)
        assert ei.value.errno == errno.ENOSPC
        _native._set_cold_room_margin(prev)
        nb.fused_rows([Region.of_tensor(s) for s in srcs], [0], dst, idx[:16] % 16, case.geom)
        ref = _run(tb, case, srcs, idx[:16] % 16, [0], None)[0]
        assert torch.equal(view.regions([Slot(0, nbytes)], nbytes, 64)[0].tensor,
                           ref.reshape(-1).view(torch.uint8))
    finally:
        _native._set_cold_room_margin(prev)
        seg.close()
        view.close()
