"""edit_shapes: the output shape and dtype of common edit ops without meta kernels.

Every answer must equal the meta kernel's; every case where the answer is not certain
must be declined (None), so the pooled path falls back to the meta kernel or the plain op.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from lmcache_kv_fast.batch._shapes import fast_out_meta

aten = torch.ops.aten


def _t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


KV = _t(2, 3, 40, 8)
CL = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
ANSWERED = {
    "cat_slices_dim2": (aten.cat.default, ([KV[:, :, :10], KV[:, :, 15:]], 2), {}),
    "cat_negative_dim": (aten.cat.default, ([KV[..., :10, :], KV[..., 15:, :]], -2), {}),
    "cat_default_dim": (aten.cat.default, ([KV, KV],), {}),
    "cat_dim_kwarg": (aten.cat.default, ([KV, KV[:1]],), {"dim": 0}),
    "stack_dim0": (aten.stack.default, ([KV[0], KV[1]],), {}),
    "stack_last": (aten.stack.default, ([KV, KV], -1), {}),
    "add_same": (aten.add.Tensor, (KV, KV.clone()), {}),
    "add_alpha": (aten.add.Tensor, (KV, KV.clone()), {"alpha": 2}),
    "sub": (aten.sub.Tensor, (KV, KV.clone()), {}),
    "mul": (aten.mul.Tensor, (KV, KV.clone()), {}),
    "div": (aten.div.Tensor, (KV, KV.clone()), {}),
    "maximum": (aten.maximum.default, (KV, KV.clone()), {}),
    "where": (aten.where.self, (KV > 0, KV, KV.clone()), {}),
    "where_scalar_other": (aten.where.self, (KV > 0, KV, torch.zeros((), dtype=torch.float64)), {}),
    "where_scalar_first": (aten.where.self, (KV > 0, torch.tensor(0.5), KV), {}),
    "mul_python_float": (aten.mul.Tensor, (KV, 0.5), {}),
    "mul_0dim_float64": (aten.mul.Tensor, (KV, torch.tensor(0.5, dtype=torch.float64)), {}),
    "div_python_int": (aten.div.Tensor, (KV, 3), {}),
    "add_scalar_overload": (aten.add.Scalar, (KV, 2.0), {}),
    "gt_scalar": (aten.gt.Scalar, (KV, 0), {}),
    "eq_tensor": (aten.eq.Tensor, (KV, KV.clone()), {}),
    "le_tensor_other_dtype": (aten.le.Tensor, (KV, KV.float()), {}),
    "flip": (aten.flip.default, (KV, [2]), {}),
    "neg": (aten.neg.default, (KV,), {}),
}
DECLINED = {
    "cat_mixed_dtypes": (aten.cat.default, ([KV, KV.float()], 0), {}),
    "cat_channels_last": (aten.cat.default, ([CL, CL], 0), {}),
    "cat_legacy_empty": (aten.cat.default, ([torch.empty(0), KV.float()], 0), {}),
    "cat_dim_out_of_range": (aten.cat.default, ([KV, KV], 4), {}),
    "cat_shapes_disagree": (aten.cat.default, ([KV, KV[:, :2]], 2), {}),
    "cat_transposed": (aten.cat.default, ([KV.transpose(2, 3), KV.transpose(2, 3)], 2), {}),
    "stack_shapes_disagree": (aten.stack.default, ([KV, KV[:1]],), {}),
    "add_broadcast": (aten.add.Tensor, (KV, KV[:, :, :1]), {}),
    "add_mixed_dtypes": (aten.add.Tensor, (KV, KV.float()), {}),
    "add_int": (aten.add.Tensor, (KV.int(), KV.int()), {}),
    "div_int": (aten.div.Tensor, (KV.int(), KV.int()), {}),
    "add_noncontiguous": (aten.add.Tensor, (KV.transpose(2, 3), KV.transpose(2, 3)), {}),
    "where_broadcast": (aten.where.self, (KV[:, :, :1] > 0, KV, KV.clone()), {}),
    "mul_complex_scalar": (aten.mul.Tensor, (KV, 1j), {}),
    "mul_int_tensor_by_float": (aten.mul.Tensor, (KV.int(), 0.5), {}),
    "gt_broadcast": (aten.gt.Tensor, (KV, KV[:, :, :1]), {}),
    "flip_of_slice": (aten.flip.default, (KV[:, :, 5:], [2]), {}),
    "where_both_scalars": (aten.where.self, (KV > 0, torch.tensor(1.0), torch.tensor(0.0)), {}),
    "where_int_and_float_scalar": (aten.where.self, (KV > 0, KV.int(), torch.tensor(0.5)), {}),
    "where_mixed_dtypes": (aten.where.self, (KV > 0, KV, KV.float()), {}),
    "other_op": (aten.index_select.default, (KV, 2, torch.tensor([1, 2])), {}),
}


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(y) for y in x)
    return x


@pytest.mark.parametrize("name", sorted(ANSWERED))
def test_answers_equal_the_meta_kernel_and_the_plain_op(name):
    func, args, kwargs = ANSWERED[name]
    got = fast_out_meta(func, args, kwargs)
    assert got is not None, name
    meta = func(*_meta(args), **_meta(kwargs))
    plain = func(*args, **kwargs)
    assert got == (tuple(meta.shape), meta.dtype) == (tuple(plain.shape), plain.dtype)
    assert plain.is_contiguous()  # a pooled (contiguous) out keeps the plain op's strides


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_uncertain_cases_are_declined(name):
    func, args, kwargs = DECLINED[name]
    assert fast_out_meta(func, args, kwargs) is None


def test_a_fresh_process_pools_common_edits_without_the_meta_machinery():
    """The first pooled cat / stack / arithmetic / comparison / flip / where of a process
    must not import sympy (torch's symbolic shapes: 0.5-2.4 s the first time a meta kernel
    of these runs)."""
    code = textwrap.dedent("""
        import sys
        import torch
        from lmcache_kv_fast.copy.select import backend
        from lmcache_kv_fast.batch._policy import PooledOutputs
        assert backend().NAME == "native", backend().NAME
        kv = torch.randn(2, 4, 2048, 256).to(torch.bfloat16)
        edits = [
            lambda kv: torch.cat([kv[..., :100, :], kv[..., 110:, :]], dim=-2),
            lambda kv: torch.stack([kv[0], kv[1]]),
            lambda kv: kv + kv.flip(2),
            lambda kv: torch.where(kv > 0, kv, kv.flip(2)),
            lambda kv: torch.where(kv > 1, kv, torch.zeros((), dtype=kv.dtype)),
            lambda kv: (kv.float() * 0.5).to(torch.bfloat16),
            lambda kv: kv - kv.flip(2),
        ]
        mode = PooledOutputs(backend().alloc_result)
        with mode:
            got = [e(kv) for e in edits]
        assert "sympy" not in sys.modules, "the meta machinery was imported"
        assert mode.pooled >= 7, mode.pooled
        for e, g in zip(edits, got):
            assert torch.equal(g, e(kv))
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
