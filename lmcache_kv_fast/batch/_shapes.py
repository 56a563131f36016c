"""Output shape and dtype of the commonest edit ops, without running a meta kernel.

``batch._policy.PooledOutputs`` needs an op's output shape and dtype before the op runs
(to hand it a pooled ``out``). The general answer is the op's meta kernel, but the first
meta call of an elementwise op, ``cat``, ``stack`` or ``where`` in a process imports
torch's symbolic-shape machinery (sympy and hundreds of modules: seconds), which a first
small ``batch.rewrite`` would pay in full. For the ops token-dropping and mixing edits
are made of, the answer is simple when the inputs agree, so it is computed here;
anything else (mixed dtypes, broadcasting, scalars, channels-last-like strides, legacy
empty tensors) returns None and goes the meta way.

Each rule only answers when the result is certain: one dtype across the inputs (so no
type promotion), dense row-major inputs (so the plain op would return a contiguous
tensor too), and shapes that match exactly where the op requires it (so the op cannot
raise for shapes; when it could, None lets the plain call raise its own error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["fast_out_meta"]

_aten = torch.ops.aten
#: Arithmetic whose result has the floating tensor operand's dtype and shape.
_ARITH = frozenset({
    _aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor,
    _aten.add.Scalar, _aten.sub.Scalar, _aten.mul.Scalar, _aten.div.Scalar,
    _aten.maximum.default, _aten.minimum.default,
})
#: Comparisons: a bool tensor of the tensor operand's shape.
_COMPARE = frozenset(getattr(getattr(_aten, name), ov)
                     for name in ("gt", "lt", "ge", "le", "eq", "ne")
                     for ov in ("Scalar", "Tensor"))
#: One tensor in, one of its shape and dtype out.
_SAME = frozenset({_aten.flip.default, _aten.neg.default})


def _plain(t: Any) -> bool:
    """A dense, row-major CPU tensor of at least one dimension (no channels-last look)."""
    return isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.dim() >= 1 and \
        t.is_contiguous() and t.device.type == "cpu"


def _row_major_view(t: Any) -> bool:
    """A CPU tensor whose plain op output would be row-major.

    Contiguous, or a view of a row-major tensor that does not look channels-last (the
    memory format torch suggests for an output is then the contiguous one).
    """
    if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or t.dim() < 1 or \
            t.device.type != "cpu":
        return False
    if t.is_contiguous():
        return True
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return False
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return False
    strides = t.stride()
    # strides that decrease along the dims (a slice of a row-major tensor) never suggest
    # channels-last: torch only suggests it when dim 1 has the smallest stride
    return all(strides[i] >= strides[i + 1] for i in range(len(strides) - 1)) and \
        strides[-1] == 1


def _scalar_like(x: Any) -> bool:
    """A Python number or a 0-dim CPU tensor that is not complex.

    Next to a dimensioned floating tensor it never changes the result's dtype (type
    promotion's categories: a dimensioned operand wins within its category, and int /
    bool are below floating), and it broadcasts to any shape.
    """
    if type(x) in (int, float, bool):
        return True
    return isinstance(x, torch.Tensor) and type(x) is torch.Tensor and x.dim() == 0 and \
        x.device.type == "cpu" and not x.dtype.is_complex


def _norm_dim(dim: Any, ndim: int) -> int | None:
    if type(dim) is not int or not -ndim <= dim < ndim:
        return None
    return dim + ndim if dim < 0 else dim


def _tensor_list(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Sequence[Any], Any]:
    """``(tensors, dim)`` of a ``cat`` / ``stack`` call.

    ``tensors`` is empty when any of them is not a row-major CPU tensor.
    """
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not all(_row_major_view(t) for t in tensors):
        return (), dim
    return tensors, dim


def _cat(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    tensors, dim = _tensor_list(args, kwargs)
    if not tensors:
        return None
    first = tensors[0]
    nd, dtype = first.dim(), first.dtype
    d = _norm_dim(dim, nd)
    if d is None:
        return None
    shape = list(first.shape)
    for t in tensors[1:]:
        if t.dim() != nd or t.dtype != dtype or \
                any(t.shape[i] != shape[i] for i in range(nd) if i != d):
            return None
        shape[d] += t.shape[d]
    return tuple(shape), dtype


def _stack(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    tensors, dim = _tensor_list(args, kwargs)
    if not tensors:
        return None
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors[1:]):
        return None
    d = _norm_dim(dim, first.dim() + 1)
    if d is None:
        return None
    shape = list(first.shape)
    shape.insert(d, len(tensors))
    return tuple(shape), first.dtype


def _binary(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    if len(args) != 2 or any(k != "alpha" for k in kwargs):
        return None
    a, b = args
    if not _plain(a) or not a.dtype.is_floating_point:
        return None
    if isinstance(b, torch.Tensor) and b.dim() > 0:
        if not _plain(b) or b.shape != a.shape or b.dtype != a.dtype:
            return None
    elif not _scalar_like(b):
        return None
    if type(kwargs.get("alpha", 1)) not in (int, float):
        return None
    return tuple(a.shape), a.dtype


def _compare(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    if len(args) != 2 or kwargs:
        return None
    a, b = args
    if not _plain(a):
        return None
    if isinstance(b, torch.Tensor) and b.dim() > 0:
        if not _plain(b) or b.shape != a.shape:
            return None
    elif not _scalar_like(b):
        return None
    return tuple(a.shape), torch.bool


def _same(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    if not args or not _plain(args[0]):
        return None
    return tuple(args[0].shape), args[0].dtype


def _where(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    if len(args) != 3 or kwargs:
        return None
    cond, a, b = args
    if not _plain(cond) or cond.dtype != torch.bool:
        return None
    dense = [x for x in (a, b) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not dense or any(not _plain(x) or x.shape != cond.shape for x in dense):
        return None
    dtype = dense[0].dtype
    if len(dense) == 2:
        if b.dtype != a.dtype:
            return None
    elif not dtype.is_floating_point or not _scalar_like(b if dense[0] is a else a):
        return None
    return tuple(cond.shape), dtype


def fast_out_meta(func: Any, args: Sequence[Any],
                  kwargs: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype] | None:
    """``(shape, dtype)`` of ``func(*args, **kwargs)``'s output when certain, else None."""
    if func is _aten.cat.default:
        return _cat(args, kwargs)
    if func is _aten.stack.default:
        return _stack(args, kwargs)
    if func in _ARITH:
        return _binary(args, kwargs)
    if func in _COMPARE:
        return _compare(args, kwargs)
    if func in _SAME:
        return _same(args, kwargs)
    if func is _aten.where.self:
        return _where(args, kwargs)
    return None
