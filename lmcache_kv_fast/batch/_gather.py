"""An edit's token-dropping gather on the native copy core: ``index_select`` / ``kv[..., idx, ...]``.

Token dropping is a gather of whole rows along the token dimension:
``kv.index_select(2, keep)`` or ``kv[:, :, keep]``. Torch runs it as one strided copy per
kept index (for ``[2, L, T, D]`` KV: ``T`` copies of ``2·L`` rows each, regular stores),
slower than moving the same bytes as runs (docs/performance.md). While
``batch._policy.PooledOutputs`` serves an edit's outputs, these two calls — with a
contiguous source, one 1-D integer index (int64 / int32) and slices of at least
:data:`MIN_ROW_BYTES` per index — are run by the core's ``index_rows`` instead:
consecutive indices coalesce into runs, each run one copy on the copy pool (streaming
stores for large outputs). The bytes are the same as torch's (a gather moves them
unchanged); every index is checked to lie in ``[0, size)`` before any byte moves, and
anything else (a negative or out-of-range index, a boolean mask, several indices, other
strides, the torch backend) runs torch's own call, which gives torch's result or raises
torch's error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_kv_fast.copy.select import backend

__all__ = ["GATHER_OPS", "MIN_ROW_BYTES", "Gather", "gather_call"]

_aten = torch.ops.aten
#: The operators recognised (``index_select`` and advanced indexing's ``index``).
GATHER_OPS = frozenset({_aten.index_select.default, _aten.index.Tensor})
#: Smallest slice per index (bytes) worth a native run: below it torch's copy is as good.
MIN_ROW_BYTES = 64
_INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Gather:
    """One recognised gather: ``out[o, i] = src[o, index[i]]`` over ``[outer, rows, row]``.

    Attributes:
        src: The source (contiguous).
        index: The 1-D integer index.
        shape: The result's shape.
        outer: Product of the sizes before the gathered dimension.
        rows: The gathered dimension's size.
        row_bytes: Bytes of one index's slice.
    """

    src: torch.Tensor
    index: torch.Tensor
    shape: tuple[int, ...]
    outer: int
    rows: int
    row_bytes: int

    @property
    def dtype(self) -> torch.dtype:
        """The result's dtype (the source's)."""
        return self.src.dtype

    def run(self, out: torch.Tensor) -> bool:
        """Gather into ``out`` (contiguous, :attr:`shape`, :attr:`dtype`).

        Returns:
            True when done; False when the core refused (an index outside ``[0, rows)``,
            anything inconsistent): nothing was written, run torch's call instead.
        """
        be = backend()
        if be.NAME != "native" or tuple(out.shape) != self.shape or out.dtype != self.dtype \
                or not out.is_contiguous() or out.device.type != "cpu":
            return False
        native = be._native
        spans = []
        for t in (out, self.src, self.index):
            st = t.untyped_storage()
            spans += [st.data_ptr(), st.nbytes(), t.data_ptr() - st.data_ptr()]
        try:
            native.index_rows(*spans, self.index.element_size(), self.index.numel(),
                              self.outer, self.rows, self.row_bytes)
        except ValueError:
            return False
        return True


def _dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is torch.Tensor and \
        t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous() and \
        not t.is_conj() and not t.is_neg() and not t.is_quantized


def _arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def gather_call(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Gather | None:
    """The gather ``func(*args, **kwargs)`` is, when the core can run it; else None."""
    if func is _aten.index_select.default:
        src, dim, index = (_arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "dim"),
                           _arg(args, kwargs, 2, "index"))
        if type(dim) is not int:
            return None
    elif func is _aten.index.Tensor:
        src, indices = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "indices")
        if not isinstance(indices, (list, tuple)):
            return None
        given = [i for i, x in enumerate(indices) if x is not None]
        if len(given) != 1:
            return None
        dim, index = given[0], indices[given[0]]
    else:
        return None
    if not _dense(src) or src.dim() < 1 or not _dense(index) or index.dim() != 1 or \
            index.dtype not in _INDEX_DTYPES:
        return None
    nd = src.dim()
    if not -nd <= dim < nd:
        return None
    dim %= nd
    shape = tuple(src.shape)
    row = src.element_size()
    for n in shape[dim + 1:]:
        row *= n
    if row < MIN_ROW_BYTES:
        return None
    outer = 1
    for n in shape[:dim]:
        outer *= n
    out_shape = (*shape[:dim], index.numel(), *shape[dim + 1:])
    return Gather(src, index, out_shape, outer, shape[dim], row)
