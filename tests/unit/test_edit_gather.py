"""The native token-dropping gather (``batch/_gather.py``, core ``index_rows``) against torch."""

from __future__ import annotations

import pytest
import torch

from lmcache_kv_fast import _native
from lmcache_kv_fast.batch._gather import MIN_ROW_BYTES, gather_call
from lmcache_kv_fast.batch._policy import PooledOutputs
from lmcache_kv_fast.copy.select import backend

pytestmark = pytest.mark.skipif(backend().NAME != "native", reason="needs the native core")
aten = torch.ops.aten


def _t(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).random_(0, 256, generator=g)
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _gathered(src: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    g = gather_call(aten.index_select.default, (src, dim, index), {})
    assert g is not None
    out = torch.empty(g.shape, dtype=g.dtype)
    assert g.run(out)
    return out


@pytest.mark.parametrize("shape,dim", [((2, 4, 1024, 512), 2), ((2, 4, 1024, 512), -2),
                                       ((3, 1000, 64), 1), ((500, 7, 32), 0),
                                       ((2, 8, 300, 3, 40), 2)])
@pytest.mark.parametrize("idx_kind", ["drop10", "reverse", "dups", "random", "empty", "one"])
@pytest.mark.parametrize("itype", [torch.int64, torch.int32])
def test_index_rows_equals_index_select(shape, dim, idx_kind, itype):
    src = _t(shape, torch.float16 if len(shape) == 3 else torch.bfloat16)
    n = shape[dim]
    g = torch.Generator().manual_seed(1)
    idx = {"drop10": [i for i in range(n) if i % 10 != 9],
           "reverse": list(range(n - 1, -1, -1)),
           "dups": [0, 0, 1, 1, 1, n - 1, n - 1, 2],
           "random": torch.randint(0, n, (n + 5,), generator=g).tolist(),
           "empty": [],
           "one": [n // 2]}[idx_kind]
    index = torch.tensor(idx, dtype=itype)
    assert src.element_size() * src[(0,) * ((dim % src.dim()) + 1)].numel() >= MIN_ROW_BYTES
    got = _gathered(src, dim, index)
    want = src.index_select(dim, index)
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))


def test_large_gather_uses_streaming_stores_and_every_thread_correctly():
    src = _t((2, 8, 2048, 1024))  # 64 MiB: above the streaming and parallel thresholds
    keep = torch.tensor([i for i in range(2048) if i % 10 != 9])
    got = _gathered(src, 2, keep)
    assert torch.equal(_bits(got), _bits(src.index_select(2, keep)))


def test_views_with_a_storage_offset_are_read_from_their_first_element():
    base = _t((4, 2, 256, 64))
    src = base[1]  # contiguous, storage offset > 0
    idx = torch.arange(255, -1, -3)
    assert torch.equal(_bits(_gathered(src, 1, idx)), _bits(src.index_select(1, idx)))
    idx_base = torch.arange(0, 300)
    idx_view = idx_base[40:90]  # an index with an offset too
    assert torch.equal(_bits(_gathered(src, 1, idx_view)), _bits(src.index_select(1, idx_view)))


@pytest.mark.parametrize("bad", [[0, 5, 256], [-1], [2**40], [3, -7]])
def test_out_of_range_indices_write_nothing_and_leave_it_to_torch(bad):
    src = _t((2, 256, 64))
    g = gather_call(aten.index_select.default, (src, 1, torch.tensor(bad)), {})
    out = torch.zeros(g.shape, dtype=g.dtype)
    assert g.run(out) is False
    assert not out.view(torch.uint8).any()  # nothing was written
    with pytest.raises(ValueError, match="outside \\[0, 256\\)"):
        _native.index_rows(out.data_ptr(), out.numel() * 2, 0, src.data_ptr(),
                           src.numel() * 2, 0, torch.tensor(bad).data_ptr(), 8 * len(bad), 0,
                           8, len(bad), 2, 256, 128)


def test_core_refuses_spans_outside_buffers_overlap_and_odd_itemsizes():
    src = _t((2, 256, 64))
    out = torch.empty(2, 10, 64, dtype=src.dtype)
    idx = torch.arange(10)
    args = dict(dst=out.data_ptr(), dst_nbytes=out.numel() * 2, dst_offset=0,
                src=src.data_ptr(), src_nbytes=src.numel() * 2, src_offset=0,
                idx=idx.data_ptr(), idx_nbytes=80, idx_offset=0, idx_itemsize=8, n_idx=10,
                outer=2, rows=256, row_bytes=128)
    _native.index_rows(**args)
    assert torch.equal(_bits(out), _bits(src[:, :10]))
    for change, msg in [({"dst_nbytes": out.numel() * 2 - 1}, "destination needs"),
                        ({"src_offset": 2}, "source needs"),
                        ({"idx_nbytes": 79}, "index needs"),
                        ({"idx_itemsize": 2}, "itemsize must be 4 or 8"),
                        ({"dst": 0}, "null address"),
                        ({"dst": src.data_ptr() + 256, "dst_nbytes": 2 * 10 * 128}, "overlap"),
                        ({"outer": 2**40, "rows": 2**40}, "overflows")]:
        with pytest.raises(ValueError, match=msg):
            _native.index_rows(**{**args, **change})


@pytest.mark.parametrize("form", ["index_select", "advanced", "advanced_trailing_slice",
                                  "int32", "list"])
def test_pooled_edit_runs_token_dropping_on_the_core(form):
    kv = _t((2, 4, 1024, 512))
    keep = torch.tensor([i for i in range(1024) if i % 10 != 9])
    fns = {"index_select": lambda x: x.index_select(2, keep),
           "advanced": lambda x: x[:, :, keep],
           "advanced_trailing_slice": lambda x: x[:, :, keep, :],
           "int32": lambda x: x.index_select(-2, keep.to(torch.int32)),
           "list": lambda x: x[:, :, keep.tolist()]}
    want = fns[form](kv)
    mode = PooledOutputs(backend().alloc_result)
    with mode:
        got = fns[form](kv)
    assert mode.native_gathers == 1 and mode.pooled == 1
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("form", ["negative", "mask", "two_indices", "strided_source",
                                  "narrow_rows", "out_of_range"])
def test_pooled_edit_leaves_other_indexing_to_torch(form):
    kv = _t((2, 4, 1024, 512))
    mask = torch.arange(1024) % 3 != 0
    fns = {"negative": lambda x: x[:, :, torch.tensor([-1, -2, 5])],
           "mask": lambda x: x[:, :, mask],
           "two_indices": lambda x: x[:, torch.tensor([0, 1]), torch.tensor([3, 4])],
           "strided_source": lambda x: x.transpose(2, 3).index_select(3, torch.arange(0, 1024, 2)),
           "narrow_rows": lambda x: x.index_select(3, torch.arange(0, 512, 2)),
           "out_of_range": lambda x: x.index_select(2, torch.tensor([0, 1024]))}
    mode = PooledOutputs(backend().alloc_result)
    if form == "out_of_range":
        with pytest.raises(IndexError), mode:
            fns[form](kv)
        assert mode.native_gathers == 0
        return
    want = fns[form](kv)
    with mode:
        got = fns[form](kv)
    assert mode.native_gathers == 0
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))
