"""What the fused kernels' tests share (test_fused_rows.py, test_fused_blocks.py).

Token indices of every shape the kernels must take, the K rotation for an index, the
output chunks a call writes, destinations filled with a sentinel byte, regions between
guard pages, and sources and tables whose rotations round every way (ties, denormals,
overflows) with a bit-for-bit check against torch that lets NaN payloads differ.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lmcache_kv_fast import _native, edits
from lmcache_kv_fast.copy.edit_kernels import Rotation
from lmcache_kv_fast.edits._rerotate import _cos_sin

SENTINEL = 0x5A  # every destination byte before a call


@dataclass(frozen=True)
class Slot:
    """A segment slot for ``regions()``."""

    offset: int
    length: int


def token_index(kind: str, rows: int, block_size: int = 0, seed: int = 0) -> torch.Tensor:
    """Source row of every output row, of ``rows`` source rows.

    ``drop10`` every 10th dropped; ``keep`` a random sorted 2/3; ``dups`` repeats in any
    order; ``shift`` every row from 5 on (each output chunk straddles two sources);
    ``same`` every row where it was; ``pairs`` two of every 20 dropped (even shifts);
    ``block`` the second engine block of ``block_size`` rows dropped; ``stride2`` every
    other row; ``reverse`` all rows backwards; ``scatter`` a random permutation;
    ``span64`` / ``span65`` each 32 outputs rows ``b .. b+30`` and ``b+63`` / ``b+64``
    (fused_blocks' lane windows: exactly 64 rows wide, one row too wide); ``shift1`` every
    row from 1 on (odd shifts only); ``runs`` runs of 1 to 12 consecutive rows from random
    starts, odd and even (fused_blocks' token rows: pairs matching or not).
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "drop10":
        idx = [t for t in range(rows) if t % 10 != 9]
    elif kind == "keep":
        idx = sorted(torch.randperm(rows, generator=gen)[: rows * 2 // 3].tolist())
    elif kind == "dups":
        idx = torch.randint(0, rows, (rows * 3 // 4,), generator=gen).tolist()
    elif kind == "shift":
        idx = list(range(5, rows))
    elif kind == "same":
        idx = list(range(rows))
    elif kind == "pairs":
        idx = [t for t in range(rows) if t % 20 < 18]
    elif kind == "block":
        idx = [t for t in range(rows) if not block_size <= t < 2 * block_size]
    elif kind == "stride2":
        idx = list(range(0, rows, 2))
    elif kind == "reverse":
        idx = list(range(rows - 1, -1, -1))
    elif kind == "scatter":
        idx = torch.randperm(rows, generator=gen).tolist()
    elif kind in ("span64", "span65"):
        last = 63 if kind == "span64" else 64
        idx = [t for b in range(0, rows - last, last + 1) for t in [*range(b, b + 31), b + last]]
    elif kind == "shift1":
        idx = list(range(1, rows))
    elif kind == "runs":
        idx = []
        while len(idx) < rows * 3 // 4:
            n = int(torch.randint(1, 13, (1,), generator=gen))
            first = int(torch.randint(0, rows - n + 1, (1,), generator=gen))
            idx += range(first, first + n)
    else:
        raise AssertionError(f"unknown index kind {kind!r}")
    return torch.tensor(idx, dtype=torch.int64)


def rotation_for(rope: edits.RoPE | None, idx: torch.Tensor) -> Rotation | None:
    """K's rotation moving each output row from its source position to its own."""
    if rope is None:
        return None
    cos, sin = _cos_sin(torch.arange(idx.numel(), dtype=torch.int64) - idx, rope)
    return Rotation(cos[:, 0].contiguous(), sin[:, 0].contiguous(), rope.head_dim,
                    rope.rotary_dim, rope.interleaved)


#: bfloat16 sources whose rotations round every way: short values (times a cos of
#: 1 + k 2^-8: ties to even), bfloat16 denormals (the smallest one too), the smallest
#: normal and values near it (products land in the denormal range or round up across its
#: top), +-0, values that overflow to infinity, and (rarely: they spread through their
#: pair) infinities and NaNs (a signaling one and one with sign and payload: NAN_BITS).
EDGE_VALUES = [1.0, 1 + 2**-7, -1 - 2**-7, 1.5, 1e-39, -3e-40, 2**-133, 2**-126, -2**-126,
               3e-38, -2.5e-38, 0.0, -0.0, 3.38e38, -3e38]
EDGE_RARE = [float("inf"), -float("inf"), float("nan")]
NAN_BITS = {torch.bfloat16: (torch.int16, [0x7f81, 0xffc5 - (1 << 16)]),
            torch.float32: (torch.int32, [0x7f800001, 0xffc00005 - (1 << 32)])}
#: cos / sin entries for EDGE_VALUES: ties (1 + k 2^-8), shrinking factors (normal
#: products below 2^-126, and 2^-126 (1 - 2^-9) rounding back up to it), a float32
#: denormal, a tiny sin (denormal products), plain ones.
EDGE_COS = [1 + 2**-8, 1 + 2**-7, 1 + 3 * 2**-8, 0.5, 1 - 2**-9, 0.75, 2**-10, 1e-40]
EDGE_SIN = [0.0, -0.0, 2**-9, 1e-38, 0.5, -0.25, 1e-40]


def _big(values: list[float]) -> list[float]:
    """The entries no rotation of them brings near the denormal range (0 or >= 2^-10)."""
    return [v for v in values if v == 0 or abs(v) >= 2**-10]


def edge_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int,
                tiny: bool = True) -> torch.Tensor:
    """A ``shape`` tensor of :data:`EDGE_VALUES` (without the tiny ones unless ``tiny``),
    one in 200 of :data:`EDGE_RARE` or :data:`NAN_BITS`; bfloat16 or float32."""
    gen = torch.Generator().manual_seed(seed)
    common = EDGE_VALUES if tiny else _big(EDGE_VALUES)
    n_rare = len(EDGE_RARE) + 2
    pick = torch.randint(0, len(common), shape, generator=gen)
    rare = torch.randint(0, 200, shape, generator=gen) == 0
    pick[rare] = len(common) + torch.randint(0, n_rare, shape, generator=gen)[rare]
    out = torch.tensor(common + EDGE_RARE + [0.0, 0.0])[pick].to(dtype)
    itype, nans = NAN_BITS[dtype]
    for k, bits in enumerate(nans):
        out.view(itype)[pick == len(common) + len(EDGE_RARE) + k] = bits
    return out


def edge_rotation(n: int, head_dim: int, rotary_dim: int, interleaved: bool, seed: int,
                  tiny: bool = True) -> Rotation:
    """A rotation of ``n`` rows whose tables draw from :data:`EDGE_COS`, :data:`EDGE_SIN`
    (without the tiny entries unless ``tiny``)."""
    gen = torch.Generator().manual_seed(seed)
    half = rotary_dim // 2
    cs, sn = (EDGE_COS, EDGE_SIN) if tiny else (_big(EDGE_COS), _big(EDGE_SIN))
    cos = torch.tensor(cs)[torch.randint(0, len(cs), (n, half), generator=gen)]
    sin = torch.tensor(sn)[torch.randint(0, len(sn), (n, half), generator=gen)]
    return Rotation(cos, sin, head_dim, rotary_dim, interleaved)


def assert_bits_as_torch(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` holds ``want``'s bytes, but for NaNs: NaN where ``want`` is, any payload.

    torch writes every NaN as 0xffff (bfloat16); the kernels keep the NaN's sign and
    payload, quieted. Floating tensors of one dtype.
    """
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaNs at other places"
    g, w = got.contiguous(), want.contiguous()
    g = g.masked_fill(nan, 0).reshape(-1).view(torch.uint8)
    w = w.masked_fill(nan, 0).reshape(-1).view(torch.uint8)
    if not torch.equal(g, w):
        bad = int((g != w).nonzero()[0, 0]) // got.element_size()
        raise AssertionError(f"{what}: element {bad}: {got.reshape(-1)[bad].item()!r} "
                             f"!= {want.reshape(-1)[bad].item()!r}")


def case_index(case: Any, seed: int = 0) -> torch.Tensor:
    """:func:`token_index` of a test's case (``index``, ``n_src``, ``chunk``, [``block_size``])."""
    return token_index(case.index, case.n_src * case.chunk, getattr(case, "block_size", 0), seed)


def case_chunk_ids(case: Any, n_out: int) -> list[int]:
    """Every whole output chunk, or (``case.subset``) half of them in a shuffled order."""
    ids = list(range(n_out // case.chunk))
    if case.subset:
        gen = torch.Generator().manual_seed(7)
        ids = [ids[i] for i in torch.randperm(len(ids), generator=gen).tolist()]
        ids = ids[: max(1, len(ids) // 2)]
    return ids


def case_blank(case: Any) -> torch.Tensor:
    """A destination chunk object of ``case.geom`` whose every byte is :data:`SENTINEL`."""
    t = torch.empty(case.geom.object_shape(), dtype=case.dtype)
    t.view(torch.uint8).fill_(SENTINEL)
    return t


def assert_refused(call: Callable[..., Any], kw: dict[str, Any], err: type[Exception],
                   pattern: str) -> None:
    """``call(**kw)`` raises ``err`` matching ``pattern``, with nothing written or changed.

    ``kw["dsts"]`` (popped) are the destination tensors, which must still be blank.
    """
    dsts = kw.pop("dsts")
    srcs_before = [r.tensor.clone() for r in kw["src_regions"] if r.tensor is not None]
    with pytest.raises(err, match=pattern):
        call(**kw)
    for d in dsts:
        assert bool((d.view(torch.uint8) == SENTINEL).all())
    after = [r.tensor for r in kw["src_regions"] if r.tensor is not None]
    assert all(torch.equal(a, b) for a, b in zip(srcs_before, after, strict=True))


def span(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage address, storage bytes, offset)``: how the core takes a tensor."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes(), t.data_ptr() - st.data_ptr()


@contextlib.contextmanager
def pool_for_every_call(threads: int = 3) -> Iterator[None]:
    """Every core call on the thread pool (``threads`` threads), so tasks split the work."""
    threshold, before = _native.get_parallel_threshold(), _native.get_threads()
    _native.set_parallel_threshold(0)
    _native.set_threads(threads)
    try:
        yield
    finally:
        _native.set_parallel_threshold(threshold)
        _native.set_threads(before)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@contextlib.contextmanager
def guarded_regions(sizes: list[int]) -> Iterator[list[int]]:
    """Regions of ``sizes`` bytes between PROT_NONE pages, as their addresses.

    Each region ends right before its second guard page, so a read past either end
    faults (SIGSEGV) instead of passing unnoticed. Unmapped on exit.
    """
    page, maps, addrs = mmap.PAGESIZE, [], []
    try:
        for n in sizes:
            body = -(-n // page) * page
            base = _LIBC.mmap(None, body + 2 * page, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            assert base is not None and base != ctypes.c_void_p(-1).value
            maps.append((base, body + 2 * page))
            assert _LIBC.mprotect(base, page, 0) == 0
            assert _LIBC.mprotect(base + page + body, page, 0) == 0
            addrs.append(base + page + body - n)
        yield addrs
    finally:
        for base, total in maps:
            _LIBC.munmap(base, total)
