"""Odd tensors against the real server, SHM and pickle planes (issue 19 items 3, 4, 7).

Each case crashed or gave wrong data before the copy layer checked tensors at its
boundary (``copy/tensor_checks.py``):

* ``store(kv)`` / ``retrieve(out=...)`` with a storage shrunk below the tensor's shape
  (``untyped_storage().resize_(4096)``), freed (``resize_(0)``) or a view past its
  storage's end: the native core read / wrote out of bounds (SIGSEGV) or raised a bare
  ``ValueError``; now ``InvalidArgumentError`` naming ``kv`` / ``out``.
* ``store(torch._neg_view(kv))`` stored the raw bytes (``kv``, not ``-kv``); now the
  logical values are stored, also shard by shard for a tensor-parallel model.
* ``retrieve(out=torch._neg_view(buf))`` left ``out`` reading back negated; now refused.
* ``connect(..., copy_threads=100000)`` raised a bare ``ValueError`` from the core; now
  ``InvalidArgumentError`` naming ``copy_threads`` and the range.

After every refused call the server holds no session, lock or staged object and the
context keeps working (the same tokens are stored and read back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import make_model, rand_tokens
from rel_helpers import Plane, install_frame_watch, open_plane, wait_clean

import lmcache_kv_fast as lkf
from lmcache_kv_fast.testing import LMCacheServer

C = 256
L, NH, HS = 2, 2, 64
D = NH * HS
T = 2 * C

install_frame_watch()


@pytest.fixture(scope="module", params=["shm", "pickle"])
def plane(request: pytest.FixtureRequest) -> Iterator[Plane]:
    yield from open_plane(request, num_layers=L, num_kv_heads=NH, head_size=HS)


def _kv(seed: int = 0, t: int = T, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, L, t, d, generator=g).bfloat16()


def _shrunk(t: torch.Tensor, nbytes: int = 4096) -> torch.Tensor:
    t.untyped_storage().resize_(nbytes)
    return t


def _past_end(t: int = T) -> torch.Tensor:
    """A contiguous view at storage offset 64 whose storage then lost its second half."""
    numel = 2 * L * t * D
    flat = torch.zeros(64 + numel, dtype=torch.bfloat16)
    view = flat[64:].view(2, L, t, D)
    flat.untyped_storage().resize_((64 + numel // 2) * 2)
    return view


BAD_STORAGE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "shrunk": (lambda: _shrunk(torch.empty(2, L, T, D, dtype=torch.bfloat16)),
               "holds only 4096 bytes"),
    "freed": (lambda: _shrunk(torch.empty(2, L, T, D, dtype=torch.bfloat16), 0), "freed"),
    "view_past_end": (_past_end, "storage offset 64"),
}


def _assert_clean_and_working(srv: LMCacheServer, ctx: lkf.LMCacheKVCacheContext,
                              toks: list[int], seed: int) -> None:
    """Nothing left on the server; the same tokens can be stored and read back."""
    left = wait_clean(srv)
    assert left == dict.fromkeys(left, 0), left
    kv = _kv(seed)
    assert ctx.store(kv, toks)
    got = ctx.retrieve(toks)
    assert got is not None and torch.equal(got, kv)
    left = wait_clean(srv)
    assert left == dict.fromkeys(left, 0), left


def _refused_before_sending(ctx: lkf.LMCacheKVCacheContext, kv: torch.Tensor) -> bool:
    """Whether the context's argument validation (no server call) refuses ``kv``.

    On the SHM plane a store refused only at the copy (after ``prepare_store``) leaves its
    reserved slots staged until the server's write TTL (600 s; there is no abort RPC), so
    the tensor checks must also run in argument validation (``copy.tensor_checks``
    ``check_source(kv, "kv")`` in the context's kv check).
    """
    check = getattr(ctx, "_check_kv", None)
    if check is None:
        return True  # validation moved: the test below tells
    try:
        check(kv)
    except lkf.InvalidArgumentError:
        return True
    return False


@pytest.mark.parametrize("case", BAD_STORAGE)
def test_store_bad_storage_kv_refused(plane: Plane, case: str) -> None:
    srv, _m, ctx = plane
    make, text = BAD_STORAGE[case]
    toks = rand_tokens(T)
    if srv.shm and not _refused_before_sending(ctx, make()):
        # Refused at the copy only (InvalidArgumentError, no crash: see the pickle plane and
        # tests/unit/test_tensor_checks.py), but after prepare_store reserved the slots.
        # Not run here so the shared server is not left with staged objects.
        pytest.xfail("the context does not call copy.tensor_checks.check_source in its kv "
                     "validation yet: an SHM store would leave staged slots")
    with pytest.raises(lkf.InvalidArgumentError, match=text) as info:
        ctx.store(make(), toks)
    assert str(info.value).startswith("kv "), str(info.value)
    assert ctx.lookup(toks) == 0
    _assert_clean_and_working(srv, ctx, toks, 1)


@pytest.mark.parametrize("case", BAD_STORAGE)
def test_retrieve_into_bad_storage_out_refused(plane: Plane, case: str) -> None:
    srv, _m, ctx = plane
    make, text = BAD_STORAGE[case]
    toks = rand_tokens(T)
    kv = _kv(2)
    assert ctx.store(kv, toks)
    with pytest.raises(lkf.InvalidArgumentError, match=text) as info:
        ctx.retrieve(toks, out=make())
    assert str(info.value).startswith("out "), str(info.value)
    left = wait_clean(srv)
    assert left == dict.fromkeys(left, 0), left
    got = ctx.retrieve(toks)  # the stored data is intact and readable
    assert got is not None and torch.equal(got, kv)
    _assert_clean_and_working(srv, ctx, rand_tokens(T), 3)


def test_store_neg_view_stores_logical_values(plane: Plane) -> None:
    srv, _m, ctx = plane
    toks = rand_tokens(T)
    kv = _kv(4)
    neg = torch._neg_view(kv)
    assert neg.is_neg()
    assert ctx.store(neg, toks)
    got = ctx.retrieve(toks)
    assert got is not None
    assert torch.equal(got, neg.resolve_neg())  # the logical values: -kv, bit-exact
    assert torch.equal(got, -kv)
    left = wait_clean(srv)
    assert left == dict.fromkeys(left, 0), left


def test_store_neg_view_tensor_parallel(server_shm: LMCacheServer) -> None:
    """Per-shard scatters (col_offset) of a neg view store its logical values too."""
    m = make_model(server_shm, layout="HND", world_size=2, num_layers=L, num_kv_heads=4,
                   head_size=32)
    toks = rand_tokens(T)
    kv = _kv(5, d=4 * 32)
    with lkf.connect(server_shm.url, server_shm.http_url, m.name, timeout=10) as ctx:
        assert ctx.world_size == 2
        assert ctx.store(torch._neg_view(kv), toks)
        got = ctx.retrieve(toks)
        assert got is not None and torch.equal(got, -kv)
    left = wait_clean(server_shm)
    assert left == dict.fromkeys(left, 0), left


def test_retrieve_into_neg_view_refused(plane: Plane) -> None:
    srv, _m, ctx = plane
    toks = rand_tokens(T)
    kv = _kv(6)
    assert ctx.store(kv, toks)
    buf = torch.zeros(2, L, T, D, dtype=torch.bfloat16)
    with pytest.raises(lkf.InvalidArgumentError, match="out has the negative bit set"):
        ctx.retrieve(toks, out=torch._neg_view(buf))
    left = wait_clean(srv)
    assert left == dict.fromkeys(left, 0), left
    got = ctx.retrieve(toks, out=buf)  # the same buffer without the bit works
    assert got is not None and torch.equal(got, kv) and torch.equal(buf, kv)
    _assert_clean_and_working(srv, ctx, rand_tokens(T), 7)


@pytest.mark.parametrize("threads", [0, 1025, 100000])
def test_connect_copy_threads_out_of_range(plane: Plane, threads: int) -> None:
    srv, m, ctx = plane
    before = lkf.copy.backend().get_threads()
    with pytest.raises(lkf.InvalidArgumentError, match="copy_threads") as info:
        lkf.connect(srv.url, srv.http_url, m.name, timeout=10, copy_threads=threads)
    if threads > 0:
        assert "[1, 1024]" in str(info.value), str(info.value)
    assert lkf.copy.backend().get_threads() == before
    _assert_clean_and_working(srv, ctx, rand_tokens(T), 8)
