"""``fused_blocks``: ``fused_rows``' token gather for a CPU engine's raw chunk objects.

``CpuEngineKV.block_offsets`` against ``to_raw``; the native kernel (csrc/fused_blocks.cpp)
against the torch backend's reference (to_tokens -> fused_rows -> to_raw) and against an
independent plain-torch path (to_tokens, cat, index_select, ``edits.rerotate``, to_raw),
bit for bit, for the vec / vec16 / amx orders, drops across chunk and block boundaries,
destination subsets, neox / interleaved / partial rotations, bfloat16, float16 and float32,
each with K's AVX-512 lane groups (csrc/fused_tiles.cpp) and V's token rows
(csrc/fused_vrows.cpp) on and forced off, with cached and streaming stores; lane windows
at their edges (64 tokens wide, ending on a block's last token, next to a guard page), V's
rows and tokens ending on their objects' last element (next to a guard page);
every refused call (Python and core checks) leaves the destinations untouched; shm
regions, cold pages on a full file system, pool splits. No server needed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
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
    guarded_regions,
    pool_for_every_call,
    rotation_for,
    span,
    token_index,
)

from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.copy import native_backend as nb
from lmcache_kv_fast.copy import torch_backend as tb
from lmcache_kv_fast.copy.base import ChunkGeometry, Region
from lmcache_kv_fast.copy.edit_kernels import Rotation
from lmcache_kv_fast.errors import InvalidArgumentError, InvalidTypeError
from lmcache_kv_fast.layout import CpuEngineKV

INTS = {2: torch.int16, 4: torch.int32}
#: fused_blocks' paths here: "generic" (token runs) always, "avx512" (lane groups) where it runs.
ISAS = ["generic"] + (["avx512"] if _native.fused_blocks_isa() == "avx512" else [])


@dataclass(frozen=True)
class Case:
    """One fused_blocks call: engine geometry, the index, the rotation, the chunks written."""

    kernel: str = "vec"
    head_dim: int = 32
    block_size: int = 16
    blocks: int = 2  # engine blocks per chunk
    heads: int = 2
    layers: int = 2
    n_src: int = 4
    dtype: torch.dtype = torch.bfloat16
    index: str = "drop10"  # a fused_support.token_index kind
    rope: str | None = None  # default | partial (None: plain)
    interleaved: bool = False
    subset: bool = False  # write only some output chunks, in a shuffled order

    @property
    def engine(self) -> CpuEngineKV:
        return CpuEngineKV(self.layers, self.heads, self.head_dim, self.dtype, self.block_size,
                           self.kernel)

    @property
    def chunk(self) -> int:
        return self.blocks * self.block_size

    @property
    def geom(self) -> ChunkGeometry:
        """The raw chunk objects' geometry: one plane, W = NH * 2 * HS."""
        return ChunkGeometry(1, self.layers, self.chunk, self.heads * 2 * self.head_dim,
                             self.dtype.itemsize)


CASES = {
    "vec-hs64-bs16-plain": Case(head_dim=64, block_size=16, blocks=4),
    "vec-hs32-bs32-neox-f32": Case(block_size=32, rope="default", dtype=torch.float32),
    "vec-hs64-bs16-interleaved": Case(head_dim=64, index="keep", rope="default",
                                      interleaved=True),
    "vec-partial-subset": Case(index="keep", rope="partial", subset=True),
    "vec-shift-dups-f32": Case(index="shift", dtype=torch.float32, blocks=4),
    "vec16-hs16-bs32-neox": Case(kernel="vec16", head_dim=16, block_size=32, rope="default"),
    "vec16-hs16-bs16-partial-interleaved-f32": Case(
        kernel="vec16", head_dim=16, rope="partial", interleaved=True, dtype=torch.float32),
    "vec16-dups-subset": Case(kernel="vec16", head_dim=16, index="dups", subset=True),
    "amx-hs64-bs32-plain": Case(kernel="amx", head_dim=64, block_size=32, blocks=4),
    "amx-hs32-bs32-neox": Case(kernel="amx", block_size=32, rope="default", index="shift"),
    "amx-hs64-interleaved-subset": Case(kernel="amx", head_dim=64, block_size=32,
                                        rope="default", interleaved=True, subset=True),
    "amx-partial-keep": Case(kernel="amx", head_dim=64, block_size=32, rope="partial",
                             index="keep"),
    "amx-same": Case(kernel="amx", block_size=32, index="same"),
    "amx-pairs-subset": Case(kernel="amx", block_size=32, blocks=4, index="pairs", subset=True),
    "amx-block-neox": Case(kernel="amx", block_size=32, index="block", rope="default"),
    "vec-same-f32": Case(index="same", dtype=torch.float32),
    "vec-pairs": Case(block_size=32, index="pairs"),
    "vec-block-f16": Case(index="block", dtype=torch.float16),
    "vec16-same-interleaved": Case(kernel="vec16", head_dim=16, index="same", rope="default",
                                   interleaved=True),
}

# W6's geometry (block 128, head 64, chunk 256) with few heads and layers: K's rows are 128
# consecutive tokens, moved in lane groups of 32 (bfloat16 / float16) or 16 (float32).
W6 = Case(head_dim=64, block_size=128, blocks=2, heads=2, layers=1, n_src=3)
LANE_CASES = {
    "w6-drop10": W6,
    "w6-keep": dataclasses.replace(W6, index="keep"),  # random: windows of 2-4, some fall back
    "w6-dups": dataclasses.replace(W6, index="dups"),  # mostly the token path
    "w6-shift": dataclasses.replace(W6, index="shift"),  # groups straddle two source blocks
    "w6-same": dataclasses.replace(W6, index="same"),  # straight groups
    "w6-pairs-subset": dataclasses.replace(W6, index="pairs", subset=True),
    "w6-block-f32": dataclasses.replace(W6, index="block", dtype=torch.float32),
    "w6-stride2-f16": dataclasses.replace(W6, index="stride2", dtype=torch.float16),
    "w6-reverse": dataclasses.replace(W6, index="reverse"),
    "w6-scatter": dataclasses.replace(W6, index="scatter"),  # the token path
    "w6-span64": dataclasses.replace(W6, index="span64"),  # windows end on a block's last token
    "w6-span65-f16": dataclasses.replace(W6, index="span65", dtype=torch.float16),
    "w6-span64-f32": dataclasses.replace(W6, index="span64", dtype=torch.float32),
    # K rotated pair of rows by pair of rows (neox, interleaved, partial: the rest copied)
    "w6-drop10-neox": dataclasses.replace(W6, rope="default"),
    "w6-shift-interleaved": dataclasses.replace(W6, index="shift", rope="default",
                                                interleaved=True),
    "w6-keep-partial-subset": dataclasses.replace(W6, index="keep", rope="partial",
                                                  subset=True),
    "w6-same-neox-f32": dataclasses.replace(W6, index="same", rope="default",
                                            dtype=torch.float32),
    "w6-span65-partial-interleaved-f32": dataclasses.replace(
        W6, index="span65", rope="partial", interleaved=True, dtype=torch.float32),
    "w6-dups-neox": dataclasses.replace(W6, index="dups", rope="default"),  # mostly tokens
    "vec-bs32-hs32-drop10-neox": Case(block_size=32, blocks=4, rope="default", heads=3),
    "vec-bs32-hs64-drop10-f16": Case(head_dim=64, block_size=32, blocks=4, dtype=torch.float16),
    "vec-bs64-hs32-shift-f32": Case(block_size=64, blocks=2, dtype=torch.float32,
                                    index="shift", heads=3),
    "vec-bs64-hs64-keep-subset": Case(head_dim=64, block_size=64, blocks=2, index="keep",
                                      subset=True),
    "vec-bs256-hs64-drop10": Case(head_dim=64, block_size=256, blocks=1, layers=1, n_src=2),
    "vec-bs48-hs48-drop10": Case(head_dim=48, block_size=48, blocks=2),  # a partial group
    "vec16-hs16-bs32-drop10": Case(kernel="vec16", head_dim=16, block_size=32, blocks=4),
    "vec16-hs16-bs16-shift-f32": Case(kernel="vec16", head_dim=16, dtype=torch.float32,
                                      index="shift", blocks=4),
    "vec16-hs48-bs96-pairs-f16": Case(kernel="vec16", head_dim=48, block_size=96,
                                      dtype=torch.float16, index="pairs"),
}

# V of vec / vec16 (one run of HS elements per token and head): whole raw rows where
# aligned pairs of both sides match (odd / even shifts, runs across blocks and chunks),
# else token by token: 128-byte runs (W6), 256 (float32), 64, 32 and 96 (masked tails).
VROW_CASES = {
    "w6-shift1": dataclasses.replace(W6, index="shift1"),
    "w6-runs": dataclasses.replace(W6, index="runs", n_src=4),
    "w6-runs-f32": dataclasses.replace(W6, index="runs", dtype=torch.float32),
    "w6-pairs-f16": dataclasses.replace(W6, index="pairs", dtype=torch.float16),
    "w6-same-subset": dataclasses.replace(W6, index="same", subset=True, n_src=4),
    "w6-runs-neox": dataclasses.replace(W6, index="runs", rope="default"),
    "vec-bs16-hs64-runs": Case(head_dim=64, block_size=16, blocks=4, heads=3, index="runs"),
    "vec-bs32-hs32-shift1-f32": Case(block_size=32, blocks=2, dtype=torch.float32,
                                     index="shift1"),
    "vec16-hs16-bs32-runs-f32": Case(kernel="vec16", head_dim=16, block_size=32,
                                     dtype=torch.float32, index="runs"),
    "vec16-hs16-bs32-shift1": Case(kernel="vec16", head_dim=16, block_size=32, index="shift1"),
    "vec16-hs48-bs96-runs-f16": Case(kernel="vec16", head_dim=48, block_size=96,
                                     dtype=torch.float16, index="runs"),
}


# ------------------------------------------------------------------ block_offsets
def _arange_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Distinct values (float32: exact integers) or, for bfloat16, distinct bit patterns."""
    n = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64)
    if dtype == torch.float32:
        return n.to(torch.float32).view(shape)
    assert n.numel() <= 1 << 16
    return n.to(torch.int32).to(torch.int16).view(dtype).view(shape)  # wraps: still distinct


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64) if t.dtype == torch.float32 else t.view(torch.int16).to(torch.int64)


@pytest.mark.parametrize("kernel,hs,bs,dtype", [
    ("vec", 64, 16, torch.float32), ("vec", 32, 32, torch.float32),
    ("vec16", 16, 32, torch.float32), ("vec16", 16, 16, torch.float32),
    ("amx", 64, 32, torch.bfloat16), ("amx", 32, 32, torch.bfloat16)])
def test_block_offsets_address_to_raw(kernel: str, hs: int, bs: int, dtype: torch.dtype) -> None:
    """Every per-token element lands in the raw rows where the tables say."""
    layers, nh, tokens = 2, 3, 2 * bs
    eng = CpuEngineKV(layers, nh, hs, dtype, bs, kernel)
    tables = eng.block_offsets()
    assert tables is not None
    tok, dim = tables
    assert tok.dtype == dim.dtype == torch.int64
    assert tuple(tok.shape) == (2, bs) and tuple(dim.shape) == (2, hs)
    kv = _arange_bits((2, layers, tokens, nh * hs), dtype)
    raw = _as_ints(eng.to_raw(kv)).reshape(-1)
    w = nh * 2 * hs
    p, lay, t, h, d = torch.meshgrid(*(torch.arange(n) for n in (2, layers, tokens, nh, hs)),
                                     indexing="ij")
    at = lay * tokens * w + t // bs * bs * w + h * 2 * hs + tok[p, t % bs] + dim[p, d]
    assert torch.equal(raw[at], _as_ints(kv).view(2, layers, tokens, nh, hs))


@pytest.mark.parametrize("bs,hs", [(24, 16), (3, 16)])
def test_block_offsets_none_without_the_single_copy_path(bs: int, hs: int) -> None:
    assert CpuEngineKV(2, 2, hs, torch.float32, bs, "vec").block_offsets() is None
    assert CpuEngineKV(2, 2, hs, torch.float32, bs, "vec").block_offset_lists() is None


def test_block_offset_lists_are_the_tables_shared_and_immutable() -> None:
    """What the kernels are handed per call: the tables flattened, one cached tuple pair;
    the public tables stay copies (changing one changes nothing the kernels see)."""
    eng = CpuEngineKV(2, 4, 64, torch.bfloat16, 128, "vec")
    lists = eng.block_offset_lists()
    assert lists is not None and all(isinstance(x, tuple) for x in lists)
    assert lists is CpuEngineKV(2, 4, 64, torch.bfloat16, 128, "vec").block_offset_lists()
    tables = eng.block_offsets()
    assert tables is not None
    assert [t.reshape(-1).tolist() for t in tables] == [list(x) for x in lists]
    tables[0].zero_()
    assert eng.block_offsets()[0].reshape(-1).tolist() == list(lists[0])


# ------------------------------------------------------------------ helpers
def _rope(case: Case) -> edits.RoPE:
    cfg = {"model_type": "llama", "head_dim": case.head_dim, "rope_theta": 500000.0}
    if case.rope == "partial":
        cfg["partial_rotary_factor"] = 0.5
    return dataclasses.replace(edits.rope_from_config(cfg), interleaved=case.interleaved)


def _sources(case: Case, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(case.geom.object_shape(), generator=gen) * 3).to(case.dtype)
            for _ in range(case.n_src)]


def _rotation(case: Case, idx: torch.Tensor) -> Rotation | None:
    return rotation_for(_rope(case) if case.rope is not None else None, idx)


def _plain_torch(case: Case, srcs: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """``[L, n_out, W]`` raw rows computed the independent way (whole chunks only)."""
    eng = case.engine
    out = torch.cat([eng.to_tokens(s[0]) for s in srcs], dim=2).index_select(2, idx)
    if case.rope is not None:
        edits.rerotate(out, idx, _rope(case), inplace=True)
    whole = idx.numel() // case.chunk * case.chunk
    return eng.to_raw(out[:, :, :whole].contiguous())


def _run(backend: object, case: Case, srcs: list[torch.Tensor], idx: torch.Tensor,
         ids: list[int], rotation: Rotation | None) -> list[torch.Tensor]:
    dsts = [case_blank(case) for _ in ids]
    backend.fused_blocks([Region.of_tensor(s) for s in srcs], ids,  # type: ignore[attr-defined]
                         [Region.of_tensor(d) for d in dsts], idx, case.geom, case.engine,
                         rotation)
    return dsts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test using it once per path of fused_blocks (lane groups on / forced off)."""
    _native._set_fused_blocks_isa(request.param)
    try:
        yield request.param
    finally:
        _native._set_fused_blocks_isa("auto")


# ------------------------------------------------------------------ results
@pytest.mark.parametrize("name", list(CASES))
def test_native_equals_torch_reference_and_plain_torch(name: str, isa: str) -> None:
    _check_against_references(CASES[name])


@pytest.mark.parametrize("name", list(LANE_CASES))
def test_lane_groups_equal_torch_reference_and_plain_torch(name: str, isa: str) -> None:
    """K's rows of consecutive tokens (vec / vec16), every edge of the lane windows."""
    _check_against_references(LANE_CASES[name])


@pytest.fixture(params=[False, True], ids=["cached", "stream"])
def stores(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Every test using it with cached stores, and with streaming ones (threshold 0)."""
    before = _native.get_stream_threshold()
    if request.param:
        _native.set_stream_threshold(0)
    try:
        yield request.param
    finally:
        _native.set_stream_threshold(before)


@pytest.mark.parametrize("name", list(VROW_CASES))
def test_token_rows_equal_torch_reference_and_plain_torch(name: str, isa: str,
                                                          stores: bool) -> None:
    """V's runs per token (vec / vec16): whole rows where pairs match, else token by token."""
    _check_against_references(VROW_CASES[name])


@pytest.mark.parametrize("name", ["w6-drop10", "w6-span65-f16", "w6-drop10-neox",
                                  "w6-span64-f32"])
def test_lane_groups_stream_as_they_copy(name: str, isa: str, stores: bool) -> None:
    """K's lane groups (and V's rows) with streaming stores, as big calls make them."""
    _check_against_references(LANE_CASES[name])


def _check_against_references(case: Case) -> None:
    srcs, idx = _sources(case), case_index(case)
    rotation = _rotation(case, idx)
    ids = case_chunk_ids(case, idx.numel())
    got = _run(nb, case, srcs, idx, ids, rotation)
    ref = _run(tb, case, srcs, idx, ids, rotation)
    plain = _plain_torch(case, srcs, idx)
    c = case.chunk
    for i, g, r in zip(ids, got, ref, strict=True):
        assert torch.equal(_bits(g), _bits(r)), f"chunk {i}: native != torch reference"
        assert torch.equal(_bits(g[0]), _bits(plain[:, i * c:(i + 1) * c])), f"chunk {i}"
    if case.rope is not None:  # V moved unchanged, K really turned
        eng = case.engine
        toks = torch.cat([eng.to_tokens(s[0]) for s in srcs], dim=2)
        for i, g in zip(ids, got, strict=True):
            kv = eng.to_tokens(g[0])
            rows = idx[i * c:(i + 1) * c]
            assert torch.equal(_bits(kv[1]), _bits(toks[1].index_select(1, rows)))
            moved = not bool((rows == torch.arange(i * c, (i + 1) * c)).all())
            assert not moved or not torch.equal(kv[0], toks[0].index_select(1, rows))


def test_unnamed_output_chunks_stay_untouched() -> None:
    case = Case(kernel="amx", head_dim=64, block_size=32, blocks=1, index="keep",
                rope="default")
    srcs, idx = _sources(case), case_index(case)
    n_chunks = idx.numel() // case.chunk
    pool = [case_blank(case) for _ in range(n_chunks)]
    ids = [n_chunks - 1, 0]
    nb.fused_blocks([Region.of_tensor(s) for s in srcs], ids,
                    [Region.of_tensor(pool[i]) for i in ids], idx, case.geom, case.engine,
                    _rotation(case, idx))
    plain = _plain_torch(case, srcs, idx)
    for i, t in enumerate(pool):
        if i in ids:
            assert torch.equal(_bits(t[0]), _bits(plain[:, i * case.chunk:(i + 1) * case.chunk]))
        else:
            assert bool((t.view(torch.uint8) == SENTINEL).all()), f"chunk {i} was written"


def test_nothing_to_write() -> None:
    case = Case()
    srcs = _sources(case)
    empty = torch.empty(0, dtype=torch.int64)
    for be in (nb, tb):
        be.fused_blocks([Region.of_tensor(s) for s in srcs], [], [], empty, case.geom, case.engine)
        be.fused_blocks([], [], [], empty, case.geom, case.engine)


@pytest.fixture
def small_pool_tasks() -> Iterator[None]:
    """Every call on the pool (3 threads), so tasks split the work."""
    with pool_for_every_call(3):
        yield


@pytest.mark.parametrize("name", ["vec-hs64-bs16-interleaved", "amx-hs32-bs32-neox",
                                  "vec16-dups-subset"])
def test_pool_split_matches(name: str, small_pool_tasks: None) -> None:
    case = CASES[name]
    srcs, idx = _sources(case), case_index(case)
    rotation = _rotation(case, idx)
    ids = case_chunk_ids(case, idx.numel())
    got = _run(nb, case, srcs, idx, ids, rotation)
    ref = _run(tb, case, srcs, idx, ids, rotation)
    assert all(torch.equal(_bits(g), _bits(r)) for g, r in zip(got, ref, strict=True))


# ------------------------------------------------------------------ guard pages
def _raw_bits(t: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as an int64."""
    return t.view(INTS[t.element_size()]).to(torch.int64)


def _by_tables(srcs: list[torch.Tensor], idx: torch.Tensor, ids: list[int], tok: torch.Tensor,
               dim: torch.Tensor) -> list[torch.Tensor]:
    """Destination objects' bits (one head, one block per chunk) gathered via the tables."""
    layers, c, w = srcs[0].shape[1:]
    p, lay, t, d = torch.meshgrid(*(torch.arange(n) for n in (2, layers, c, dim.shape[1])),
                                  indexing="ij")
    def at(tokens: torch.Tensor) -> torch.Tensor:
        return lay * c * w + tok[p, tokens] + dim[p, d]
    flat = torch.stack([_raw_bits(s).reshape(-1) for s in srcs])
    out = []
    for i in ids:
        rows = idx[i * c:(i + 1) * c][t]
        dst = torch.zeros(layers * c * w, dtype=torch.int64)
        dst[at(t)] = flat[rows // c, at(rows % c)]
        out.append(dst)
    return out


@pytest.mark.parametrize("dtype,bs,kind", [
    (torch.bfloat16, 128, "drop10"), (torch.bfloat16, 128, "span64"),
    (torch.float16, 128, "shift"), (torch.float32, 64, "drop10"), (torch.float32, 64, "reverse")])
def test_lane_windows_read_nothing_past_their_source_objects(dtype: torch.dtype, bs: int,
                                                             kind: str, isa: str) -> None:
    """Masked window loads stay inside the source objects, next to guard pages.

    K is placed after V in each block (tables the core takes, not an engine's), so the
    last K row's last token is its source object's last element, right before a
    PROT_NONE page; reading a window's whole registers there would fault.
    """
    _guarded_call("vec", dtype, bs, 64, kind, k_last=True)


@pytest.mark.parametrize("bs,hs,kind", [(32, 64, "drop10"), (64, 32, "shift"),
                                         (32, 32, "reverse")])
def test_pair_lanes_read_nothing_past_their_source_objects(bs: int, hs: int, kind: str,
                                                           isa: str) -> None:
    """amx's K in lane groups of token pairs of dims stays inside its objects (K last)."""
    _guarded_call("amx", torch.bfloat16, bs, hs, kind, k_last=True)


@pytest.mark.parametrize("kernel,dtype,bs,hs,kind", [
    ("vec", torch.bfloat16, 128, 64, "drop10"), ("vec", torch.bfloat16, 128, 64, "same"),
    ("vec", torch.float32, 64, 64, "shift1"), ("vec16", torch.float16, 96, 48, "runs"),
    ("vec16", torch.bfloat16, 32, 16, "shift1"), ("vec16", torch.float32, 32, 16, "runs"),
    ("amx", torch.bfloat16, 32, 64, "drop10"), ("amx", torch.bfloat16, 64, 32, "shift1"),
    ("amx", torch.bfloat16, 32, 32, "same")])
def test_token_rows_read_nothing_past_their_source_objects(kernel: str, dtype: torch.dtype,
                                                           bs: int, hs: int, kind: str,
                                                           isa: str, stores: bool) -> None:
    """V's rows, token runs (masked tails too) and amx's token pairs stop at their objects'
    last element.

    In an engine's blocks V's rows come last, so the last V row of a one-block chunk ends
    its object, right before a PROT_NONE page.
    """
    _guarded_call(kernel, dtype, bs, hs, kind, k_last=False)


def _guarded_call(kernel: str, dtype: torch.dtype, bs: int, hs: int, kind: str, *,
                  k_last: bool) -> None:
    """One-head, one-block chunks in guarded source regions, checked against the tables."""
    layers, n_src = 2, 3
    tables = CpuEngineKV(layers, 1, hs, dtype, bs, kernel).block_offsets()
    assert tables is not None
    tok, dim = tables
    if k_last:
        v_first = int(tok[1].min())  # V's first element: after K's rows in an engine's blocks
        dim[0] += v_first
        tok[1] -= v_first
    geom = ChunkGeometry(1, layers, bs, 2 * hs, dtype.itemsize)  # a chunk is one block
    nbytes = geom.chunk_nbytes
    srcs = [(torch.randn(geom.object_shape()) * 3).to(dtype) for _ in range(n_src)]
    idx = token_index(kind, n_src * bs)
    ids = list(range(idx.numel() // bs))
    dsts = [torch.full((nbytes,), SENTINEL, dtype=torch.uint8) for _ in ids]
    with guarded_regions([nbytes] * n_src) as addrs:
        for a, src in zip(addrs, srcs, strict=True):
            ctypes.memmove(a, src.data_ptr(), nbytes)
        _native.fused_blocks(
            src_addrs=addrs, src_nbytes=[nbytes] * n_src, src_owners=None, dst_ids=ids,
            dst_addrs=[t.data_ptr() for t in dsts], dst_nbytes=[nbytes] * len(ids),
            dst_owners=None, idx=span(idx), n_out=idx.numel(),
            geometry=(layers, bs, 2 * hs, dtype.itemsize, bs, hs),
            tok_off=tok.reshape(-1).tolist(), dim_off=dim.reshape(-1).tolist(), cos=(0, 0, 0),
            sin=(0, 0, 0), head_dim=0, rotary_dim=0, interleaved=False, dtype="")
    for got, want in zip(dsts, _by_tables(srcs, idx, ids, tok, dim), strict=True):
        assert torch.equal(_raw_bits(got.view(dtype)), want)


#: The rounding test's layouts: K's lane groups (W6: neox, partial, interleaved, float32)
#: and the token path's rows (amx; W6 with the lane groups forced off).
EDGE_CASES = {
    "w6-neox": dataclasses.replace(W6, rope="default"),
    "w6-keep-partial": dataclasses.replace(W6, index="keep", rope="partial"),
    "w6-shift-interleaved": dataclasses.replace(W6, index="shift", rope="default",
                                                interleaved=True),
    "w6-neox-f32": dataclasses.replace(W6, rope="default", dtype=torch.float32),
    "amx-hs64-neox": Case(kernel="amx", head_dim=64, block_size=32, rope="default"),
    "vec16-hs32-partial": Case(kernel="vec16", head_dim=32, rope="partial", index="keep"),
}


def _edge_run(case: Case, tiny: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fused_blocks on :func:`edge_values` sources and tables: (native, torch reference)."""
    shape = case.geom.object_shape()
    srcs = [edge_values(shape, case.dtype, seed, tiny) for seed in range(case.n_src)]
    idx, rope = case_index(case), _rope(case)
    rotation = edge_rotation(idx.numel(), rope.head_dim, rope.rotary_dim, case.interleaved, 5,
                             tiny)
    ids = case_chunk_ids(case, idx.numel())
    return _run(nb, case, srcs, idx, ids, rotation), _run(tb, case, srcs, idx, ids, rotation)


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_rotation_rounds_as_torch(name: str, isa: str) -> None:
    """K's rotation (lane groups, token rows) rounds as torch: ties to even, denormal inputs
    and results kept (the BF16 instructions would flush them), the denormal range's top
    rounding up to the smallest normal, +-0, overflows to infinity, infinities and NaNs
    (payloads aside)."""
    got, ref = _edge_run(EDGE_CASES[name])
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert_bits_as_torch(g, r, f"output chunk {i}")
    k = torch.stack(ref).float()
    assert bool(((k != 0) & (k.abs() < 2**-126)).any()), "no denormal result was tested"


@pytest.mark.skipif("avx512" not in ISAS, reason="no AVX-512BW: no lane groups")
@pytest.mark.parametrize("tiny", [True, False], ids=["tiny", "no-tiny"])
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_lane_and_token_paths_write_the_same_bytes(name: str, tiny: bool) -> None:
    """Lane groups and the forced-portable path agree byte for byte, NaN payloads too, with
    and without denormals about (the token path's row kernel rounds vectors holding one
    on the bits, the others with vcvtneps2bf16)."""
    runs = []
    for isa in ("avx512", "generic"):
        _native._set_fused_blocks_isa(isa)
        try:
            runs.append(_edge_run(EDGE_CASES[name], tiny)[0])
        finally:
            _native._set_fused_blocks_isa("auto")
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*runs, strict=True))
    if not tiny:
        k = torch.stack(runs[0]).float()
        assert not bool(((k != 0) & (k.abs() < 2**-126)).any())
        assert bool(k.isnan().any())


def test_isa_switch() -> None:
    """``fused_blocks_isa`` follows ``_set_fused_blocks_isa``; unknown names are refused."""
    try:
        _native._set_fused_blocks_isa("generic")
        assert _native.fused_blocks_isa() == "generic"
        _native._set_fused_blocks_isa("auto")
        assert _native.fused_blocks_isa() == ISAS[-1]
        with pytest.raises(ValueError, match="isa must be"):
            _native._set_fused_blocks_isa("avx9")
    finally:
        _native._set_fused_blocks_isa("auto")


# ------------------------------------------------------------------ shm regions
def test_mapped_regions(shm_segments: Callable[[int], str]) -> None:
    """Sources and destinations in a real shm segment (MappedRegion)."""
    case = Case(kernel="amx", head_dim=64, block_size=32, index="keep", rope="default")
    srcs, idx = _sources(case), case_index(case)
    ids = case_chunk_ids(case, idx.numel())
    rotation = _rotation(case, idx)
    nbytes = case.geom.chunk_nbytes
    slots = [Slot(k * nbytes, nbytes) for k in range(case.n_src + len(ids))]
    name = shm_segments(len(slots) * nbytes)
    seg, view = nb.open_segment(name), tb.open_segment(name)
    try:
        mapped = seg.regions(slots, nbytes, 64)
        flat = view.regions(slots, nbytes, 64)  # the same bytes, through torch's mmap
        for k, s in enumerate(srcs):
            flat[k].tensor.copy_(s.reshape(-1).view(torch.uint8))
        nb.fused_blocks(mapped[:case.n_src], ids, mapped[case.n_src:], idx, case.geom,
                        case.engine, rotation)
        ref = _run(tb, case, srcs, idx, ids, rotation)
        for f, r in zip(flat[case.n_src:], ref, strict=True):
            assert torch.equal(f.tensor, _bits(r).reshape(-1))
    finally:
        seg.close()
        view.close()


def test_cold_destinations_on_a_full_file_system_raise_enospc(
        shm_segments: Callable[[int], str]) -> None:
    """Pages not allocated yet are written only with room for them (else SIGBUS): ENOSPC."""
    case = Case()
    srcs, idx = _sources(case), case_index(case)[: Case().chunk]
    nbytes = case.geom.chunk_nbytes
    name = shm_segments(nbytes)  # sparse: its pages are not allocated yet
    seg, view = nb.open_segment(name), tb.open_segment(name)
    prev = _native._set_cold_room_margin(1 << 62)  # as if the file system were full
    try:
        dst = seg.regions([Slot(0, nbytes)], nbytes, 64)
        src_r = [Region.of_tensor(s) for s in srcs]
        with pytest.raises(OSError) as ei:
            nb.fused_blocks(src_r, [0], dst, idx, case.geom, case.engine)
        assert ei.value.errno == errno.ENOSPC
        _native._set_cold_room_margin(prev)
        nb.fused_blocks(src_r, [0], dst, idx, case.geom, case.engine)
        ref = _run(tb, case, srcs, idx, [0], None)[0]
        assert torch.equal(view.regions([Slot(0, nbytes)], nbytes, 64)[0].tensor,
                           _bits(ref).reshape(-1))
    finally:
        _native._set_cold_room_margin(prev)
        seg.close()
        view.close()


# ------------------------------------------------------------------ refused calls (Python)
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
              geom=case.geom, engine=case.engine, rotation=rotation, dsts=dsts)
    n_rows = case.n_src * case.chunk
    g, err = case.geom, InvalidArgumentError
    simple: dict[str, tuple[dict, type[Exception], str]] = {
        "engine-type": (dict(engine=object()), InvalidTypeError, "engine must be a CpuEngineKV"),
        "geom-planes": (dict(geom=dataclasses.replace(g, planes=2)), err, "geometry .*planes"),
        "geom-width": (dict(geom=dataclasses.replace(g, width=g.width // 2)), err,
                       "is not the engine's raw objects'"),
        "geom-chunk": (dict(geom=dataclasses.replace(g, chunk_tokens=24)), err,
                       "chunk_tokens 24 is not a multiple of the engine's block_size 16"),
        "no-offsets": (dict(engine=CpuEngineKV(2, 2, 32, torch.bfloat16, 3, "vec"),
                            geom=dataclasses.replace(g, chunk_tokens=48)), err,
                       "no additive block offsets"),
        "rotation-head": (dict(rotation=rotation._replace(head_dim=16, rotary_dim=16)), err,
                          "rotation's head_dim 16 is not the engine's head_dim 32"),
        "rotary-odd": (dict(rotation=rotation._replace(rotary_dim=7)), err, "rotary_dim must be"),
        "cos-shape": (dict(rotation=rotation._replace(cos=rotation.cos[:-1])), err,
                      "fused_blocks: rotation.cos"),
        "rotation-f16": (dict(engine=dataclasses.replace(case.engine, dtype=torch.float16)), err,
                         "a rotation needs bfloat16 or float32"),
        "index-dtype": (dict(index=idx.int()), err, "fused_blocks: index"),
        "index-list": (dict(index=idx.tolist()), InvalidTypeError, "torch.Tensor"),
        "ids-count": (dict(dst_chunk_ids=ids[:-1]), ValueError,
                      f"{len(ids) - 1} destination chunk ids for {len(ids)} destination regions"),
        "ids-dup": (dict(dst_chunk_ids=[ids[0], *ids[:-1]]), ValueError,
                    f"destination chunk id {ids[0]} appears twice"),
        "ids-range": (dict(dst_chunk_ids=[*ids[:-1], len(ids)]), ValueError,
                      f"destination chunk id {len(ids) - 1} is {len(ids)}"),
        "ids-negative": (dict(dst_chunk_ids=[-1, *ids[1:]]), ValueError,
                         "destination chunk id 0 is -1"),
    }
    if bad in simple:
        change, err, pattern = simple[bad]
        kw.update(change)
        return kw, err, pattern
    if bad == "src-short":
        src_r[2] = Region(src_r[2].addr, src_r[2].nbytes - 2, src_r[2].tensor)
        return kw, ValueError, "fused_blocks: source region 2 holds"
    if bad == "no-tensor":
        src_r[0] = Region(src_r[0].addr, src_r[0].nbytes)
        return kw, ValueError, "fused_blocks: source.? region 0 carries"
    if bad == "overlap-src":
        dst_r[1] = src_r[3]
        return kw, ValueError, "destination region 1 overlaps source region 3"
    assert bad == "index-high"
    idx = idx.clone()
    idx[50] = n_rows
    kw["index"] = idx
    return kw, ValueError, f"index 50 is {n_rows}, outside \\[0, {n_rows}\\)"


BAD = ["engine-type", "geom-planes", "geom-width", "geom-chunk", "no-offsets", "rotation-head",
       "rotary-odd", "cos-shape", "rotation-f16", "index-dtype", "index-list", "ids-count",
       "ids-dup", "ids-range", "ids-negative", "src-short", "no-tensor", "overlap-src",
       "index-high"]


@pytest.mark.parametrize("backend", [nb, tb], ids=["native", "torch"])
@pytest.mark.parametrize("bad", BAD)
def test_refused_before_anything_is_written(backend: object, bad: str) -> None:
    assert_refused(backend.fused_blocks, *_bad_call(bad))  # type: ignore[attr-defined]


# ------------------------------------------------------------------ refused calls (core)
def _core_args(case: Case, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
               idx: torch.Tensor, rot: Rotation) -> dict:
    g, eng = case.geom, case.engine
    tok, dim = eng.block_offsets()  # type: ignore[misc]
    return dict(
        src_addrs=[s.data_ptr() for s in srcs], src_nbytes=[g.chunk_nbytes] * len(srcs),
        src_owners=None, dst_ids=[2, 0], dst_addrs=[d.data_ptr() for d in dsts],
        dst_nbytes=[g.chunk_nbytes] * len(dsts), dst_owners=None, idx=span(idx),
        n_out=idx.numel(), geometry=(g.layers, g.chunk_tokens, g.width, g.itemsize,
                                     eng.block_size, eng.head_dim),
        tok_off=tok.reshape(-1).tolist(), dim_off=dim.reshape(-1).tolist(), cos=span(rot.cos),
        sin=span(rot.sin), head_dim=eng.head_dim, rotary_dim=rot.rotary_dim,
        interleaved=False, dtype="bfloat16")


def _geometry(args: dict, **change: int) -> tuple[int, ...]:
    names = ["layers", "chunk", "width", "itemsize", "bs", "hs"]
    return tuple(change.get(n, v) for n, v in zip(names, args["geometry"], strict=True))


def _swap_tok(args: dict) -> list[int]:
    tok = list(args["tok_off"])
    tok[0], tok[1] = tok[1], tok[1]  # two tokens of K on the same cells
    return tok


CORE_BAD: dict[str, tuple[Callable[[dict], dict], str]] = {
    "geometry-len": (lambda a: dict(geometry=a["geometry"][:5]), "geometry must be 6 integers"),
    "zero-geometry": (lambda a: dict(geometry=_geometry(a, bs=0)), "must be >= 1"),
    "chunk-blocks": (lambda a: dict(geometry=_geometry(a, bs=12)),
                     "chunk_tokens 32 is not a multiple of block_size 12"),
    "width-heads": (lambda a: dict(geometry=_geometry(a, width=96)),
                    "width 96 is not a whole number of heads of 2 x 32"),
    "head-size": (lambda a: dict(head_dim=16, rotary_dim=16), "head_dim 16 is not head_size 32"),
    "itemsize": (lambda a: dict(dtype="float32"), "needs itemsize 4"),
    "rotary-odd": (lambda a: dict(rotary_dim=7), "rotary_dim must be even"),
    "dtype-name": (lambda a: dict(dtype="float16"), "dtype must be"),
    "overflow": (lambda a: dict(geometry=_geometry(a, layers=1 << 40, chunk=1 << 30, bs=16)),
                 "overflows 64 bits"),
    "tok-shape": (lambda a: dict(tok_off=a["tok_off"][:-1]), "tok_off has 31 entries"),
    "dim-shape": (lambda a: dict(dim_off=[*a["dim_off"], 0]), "dim_off has 65 entries"),
    "tok-huge": (lambda a: dict(tok_off=[1 << 62, *a["tok_off"][1:]]),
                 r"tok_off\[0\]\[0\] is 4611686018427387904, beyond"),
    "outside-cells": (lambda a: dict(dim_off=[a["dim_off"][0] + 64, *a["dim_off"][1:]]),
                      r"\(plane 0, token 0, dim 0\) is at offset 64, outside its block's cells"),
    "negative-cell": (lambda a: dict(tok_off=[-1, *a["tok_off"][1:]]),
                      r"\(plane 0, token 0, dim 0\) is at offset -1"),
    "cell-twice": (lambda a: dict(tok_off=_swap_tok(a)),
                   r"\(plane 0, token 1, dim 0\) and \(plane 0, token 0, dim 0\)|"
                   r"\(plane 0, token 0, dim 0\) and \(plane 0, token 1, dim 0\)"),
    "src-count": (lambda a: dict(src_nbytes=a["src_nbytes"][:-1]), "source addresses for"),
    "null-addr": (lambda a: dict(dst_addrs=[0, a["dst_addrs"][1]]),
                  "destination region 0 has a null address"),
    "dst-short": (lambda a: dict(dst_nbytes=[100, a["dst_nbytes"][1]]),
                  r"destination region 0 holds 100 bytes, expected at least 16384 \(one \[2, 32, "
                  r"128\] x 2 chunk\)"),
    "misaligned": (lambda a: dict(dst_addrs=[a["dst_addrs"][0] + 1, a["dst_addrs"][1]]),
                   "destination region 0 at .* is not aligned to its 2-byte elements"),
    "ids-dup": (lambda a: dict(dst_ids=[0, 0]), "destination chunk id 0 appears twice"),
    "ids-range": (lambda a: dict(dst_ids=[9, 0]), "destination chunk id 0 is 9: its output"),
    "ids-negative": (lambda a: dict(dst_ids=[-2, 0]), "destination chunk id 0 is -2, < 0"),
    "idx-span": (lambda a: dict(idx=(a["idx"][0], a["idx"][1] - 8, a["idx"][2])),
                 "index needs bytes"),
    "cos-span": (lambda a: dict(cos=(a["cos"][0], a["cos"][1] - 4, a["cos"][2])),
                 "cos needs bytes"),
    "overlap-dst": (lambda a: dict(dst_addrs=[a["dst_addrs"][0], a["dst_addrs"][0] + 64]),
                    "destination regions 0 and 1 overlap"),
    "overlap-src": (lambda a: dict(dst_addrs=[a["src_addrs"][3], a["dst_addrs"][1]]),
                    "destination region 0 overlaps source region 3"),
    "owners-count": (lambda a: dict(dst_owners=[None]), "1 owners for 2 destination regions"),
}


@pytest.mark.parametrize("bad", [*CORE_BAD, "index-value", "overlap-table", "owner-type"])
def test_core_refuses_before_anything_is_written(bad: str) -> None:
    """The core's own checks, called without the Python layer's: ValueError "fused_blocks: "."""
    case = Case(rope="default")
    srcs, idx = _sources(case), case_index(case)
    rot = _rotation(case, idx)
    assert rot is not None
    dsts = [case_blank(case) for _ in range(2)]
    big = torch.full((case.geom.chunk_nbytes * 2,), SENTINEL, dtype=torch.uint8)
    args = _core_args(case, srcs, dsts, idx, rot)
    err: type[Exception] = ValueError
    if bad in CORE_BAD:
        change, pattern = CORE_BAD[bad]
        args.update(change(args))
        if bad == "overlap-dst":
            args["dst_addrs"] = [big.data_ptr(), big.data_ptr() + 64]
    elif bad == "index-value":
        bad_idx = idx.clone()
        bad_idx[7] = -4
        args["idx"], pattern = span(bad_idx), r"index 7 is -4, outside \[0, 128\)"
    elif bad == "overlap-table":  # the tables inside a destination region
        tables = torch.zeros(case.geom.chunk_nbytes // 4, dtype=torch.float32)
        n = rot.cos.numel()
        tables[:n] = rot.cos.reshape(-1)
        args["cos"], args["dst_addrs"][0] = span(tables[:n]), tables.data_ptr()
        del dsts[0]
        pattern = "a destination region overlaps cos or sin"
    else:
        args["src_owners"], err, pattern = [object()] * len(srcs), TypeError, "owner 0 is not"
    with pytest.raises(err, match=pattern) as ei:
        _native.fused_blocks(**args)
    assert bad == "dtype-name" or "fused_blocks" in str(ei.value)
    for d in dsts:
        assert bool((d.view(torch.uint8) == SENTINEL).all())
    assert bool((big == SENTINEL).all())
